-- wrk script: POST the benchmark's charge with an Idempotency-Key per request.
--
-- wrk -s post.lua URL -- MODE TOKEN KEYS
--   MODE "new":    a fresh key per request: <KEYS>-<thread>-<n> (KEYS is a run prefix)
--   MODE "replay": cycle through the keys listed one per line in the file KEYS
-- done() prints one JSON line: requests, duration, latency percentiles, errors.

local threads = {}

function setup(thread)
   thread:set("tid", #threads + 1)
   table.insert(threads, thread)
end

function init(args)
   mode = args[1]
   wrk.method = "POST"
   wrk.body = '{"amount": 1000, "currency": "EUR", "description": "bench"}'
   wrk.headers["Content-Type"] = "application/json"
   wrk.headers["Authorization"] = "Token " .. args[2]
   counter = 0
   if mode == "replay" then
      keys = {}
      for line in io.lines(args[3]) do
         table.insert(keys, line)
      end
      counter = tid * 7919
   else
      prefix = args[3] .. "-" .. tid
   end
end

function request()
   counter = counter + 1
   if mode == "replay" then
      wrk.headers["Idempotency-Key"] = keys[(counter % #keys) + 1]
   else
      wrk.headers["Idempotency-Key"] = prefix .. "-" .. counter
   end
   return wrk.format()
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      '{"requests": %d, "duration_us": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, '
      .. '"status_errors": %d, "connect_errors": %d, "read_errors": %d, '
      .. '"write_errors": %d, "timeouts": %d}\n',
      summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
      latency:percentile(99), e.status, e.connect, e.read, e.write, e.timeout))
end
