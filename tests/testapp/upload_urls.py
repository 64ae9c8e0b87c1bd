"""Views taking uploads by ``PATCH`` and ``PUT`` as well as ``POST``
(``tests/test_fingerprint_uploads.py`` uses them with ``pytest.mark.urls``): a DRF view whose
permission reads ``request.data`` before the claim, a plain DRF view, and a django-ninja
operation reading ``request.FILES`` (which ninja fills for ``PATCH`` and ``PUT`` through its
``fix_request_files_middleware``). Each writes one charge per run."""

from __future__ import annotations

from typing import Any

from django.urls import URLPattern, URLResolver

urlpatterns: list[URLPattern | URLResolver] = []

try:
    from rest_framework.parsers import BaseParser, MultiPartParser
    from rest_framework.permissions import BasePermission
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView
except ImportError:  # the tox env 'core' runs without DRF
    pass
else:
    from django.conf import settings
    from django.http import QueryDict
    from django.urls import path

    from django_idempotency import sources
    from django_idempotency.drf import IdempotencyMixin
    from tests.testapp.models import Charge

    class ReadsData(BasePermission):
        """Parses the body before the claim, as a permission on the payload does: the
        request's stream is consumed then, and only what DRF parsed is left."""

        def has_permission(self, request: Any, view: Any) -> bool:
            return request.data is not None

    class UploadView(IdempotencyMixin, APIView):
        permission_classes = [ReadsData]
        idempotency_methods = ("POST", "PATCH", "PUT")

        def post(self, request: Request) -> Response:
            data: Any = request.data
            Charge.objects.create(account="upload", amount=1, currency="EUR")
            return Response({"content": data["file"].read().decode(), "note": data["note"]})

        patch = put = post

    class PlainUploadView(UploadView):
        permission_classes: list[Any] = []

    class StreamFormParser(BaseParser):
        """An urlencoded form parsed from the request's stream, as DRF's ``FormParser``
        did before 3.18 (from 3.18 on it reads ``request.body``, which stays readable)."""

        media_type = "application/x-www-form-urlencoded"

        def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
            encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
            return QueryDict(stream.read(), encoding=encoding)

    class FormKeyView(IdempotencyMixin, APIView):
        """The key a form field (``sources.form``), the body read by the permission first
        (from the stream: the body is gone, DRF's parsed form is left)."""

        permission_classes = [ReadsData]
        parser_classes = [StreamFormParser, MultiPartParser]
        idempotency_methods = ("POST", "PATCH", "PUT")
        idempotency_key = sources.form("idempotency_key")

        def post(self, request: Request) -> Response:
            Charge.objects.create(account="form-key", amount=1, currency="EUR")
            data: Any = request.data
            return Response({"note": data["note"]})

        patch = put = post

    urlpatterns = [
        path("uploads/read-first/", UploadView.as_view()),
        path("uploads/drf/", PlainUploadView.as_view()),
        path("uploads/form-key/", FormKeyView.as_view()),
    ]

try:
    from ninja import NinjaAPI
    from ninja.security import django_auth
except ImportError:  # the tox env 'core' runs without django-ninja
    pass
else:
    from django.http import HttpRequest
    from django.urls import path

    from django_idempotency.ninja import idempotent
    from tests.testapp.models import Charge

    api = NinjaAPI(urls_namespace="tests-uploads-ninja", auth=django_auth)

    @api.api_operation(["POST", "PATCH", "PUT"], "/upload")
    @idempotent(methods=["POST", "PATCH", "PUT"])
    def ninja_upload(request: HttpRequest) -> dict[str, str]:
        Charge.objects.create(account="upload", amount=1, currency="EUR")
        return {"content": request.FILES["file"].read().decode(), "note": request.POST["note"]}

    urlpatterns = [*urlpatterns, path("uploads/ninja/", api.urls)]
