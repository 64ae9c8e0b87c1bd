"""URLs of the views whose key comes from a source other than the ``Idempotency-Key``
header (``tests/test_sources.py`` uses them with ``pytest.mark.urls``)."""

from __future__ import annotations

from django.conf import settings
from django.urls import path

from tests.testapp import source_views
from tests.testapp.urls import urlpatterns as base_urlpatterns

urlpatterns = [
    *base_urlpatterns,
    path("sources/json/", source_views.json_key),
    path("sources/json-optional/", source_views.json_key_optional),
    path("sources/wrong-type/", source_views.wrong_type_key),
    path("sources/dotted/", source_views.dotted_key),
    path("sources/sender-a/", source_views.sender_a),
    path("sources/sender-b/", source_views.sender_b),
    path("sources/form/", source_views.form_submit),
]
if settings.HAS_DRF:
    from tests.testapp import source_drf_views as sd

    urlpatterns += [
        path("api/sources/function/", sd.FunctionKeyView.as_view()),
        path("api/sources/lambda/", sd.LambdaKeyView.as_view()),
        path("api/sources/static/", sd.StaticKeyView.as_view()),
        path("api/sources/source/", sd.SourceKeyView.as_view()),
        path("api/sources/dotted/", sd.DottedKeyView.as_view()),
        path("api/sources/method/", sd.MethodKeyView.as_view()),
        path("api/sources/wrong/", sd.WrongKeyView.as_view()),
        path("api/sources/api-view/", sd.api_json_key),
        path("api/sources/data-first/", sd.DataReadFirstView.as_view()),
    ]
