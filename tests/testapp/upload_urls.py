"""A DRF view taking uploads whose permission reads ``request.data`` before the claim
(``tests/test_fingerprint_uploads.py`` uses it with ``pytest.mark.urls``)."""

from __future__ import annotations

from typing import Any

from django.urls import URLPattern, URLResolver

urlpatterns: list[URLPattern | URLResolver] = []

try:
    from rest_framework.permissions import BasePermission
    from rest_framework.request import Request
    from rest_framework.response import Response
    from rest_framework.views import APIView
except ImportError:  # the tox env 'core' runs without DRF
    pass
else:
    from django.urls import path

    from django_idempotency.drf import IdempotencyMixin
    from tests.testapp.models import Charge

    class ReadsData(BasePermission):
        """Parses the body before the claim, as a permission on the payload does: the
        request's stream is consumed then, and only what DRF parsed is left."""

        def has_permission(self, request: Any, view: Any) -> bool:
            return request.data is not None

    class UploadView(IdempotencyMixin, APIView):
        permission_classes = [ReadsData]

        def post(self, request: Request) -> Response:
            data: Any = request.data
            Charge.objects.create(account="upload", amount=1, currency="EUR")
            return Response({"content": data["file"].read().decode(), "note": data["note"]})

        patch = put = post

    urlpatterns = [path("uploads/read-first/", UploadView.as_view())]
