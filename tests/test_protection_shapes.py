"""Shapes that look protected and are not are refused when they are made.

``class V(viewsets.ViewSet, IdempotencyMixin)`` puts DRF's ``dispatch`` and ``initial``
before the mixin's: the mixin never runs, yet the class names it, and before this was
refused the audit called the viewset protected while two POSTs with one key ran twice. Each
shape here is refused with ``ImproperlyConfigured`` at the class statement or the
decorator, before any request can run unprotected; the shapes that do protect are accepted.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import View

from django_idempotency.decorators import idempotent
from tests.helpers import needs_drf, needs_ninja


@needs_drf
@pytest.mark.parametrize("base", ["ViewSet", "ModelViewSet", "APIView", "GenericAPIView"])
def test_the_mixin_after_drfs_base_is_refused_when_the_class_is_made(base):
    from rest_framework import generics, views, viewsets

    from django_idempotency.drf import IdempotencyMixin

    bases = {
        "ViewSet": viewsets.ViewSet,
        "ModelViewSet": viewsets.ModelViewSet,
        "APIView": views.APIView,
        "GenericAPIView": generics.GenericAPIView,
    }
    with pytest.raises(ImproperlyConfigured, match="IdempotencyMixin must come before"):
        type("Charges", (bases[base], IdempotencyMixin), {"__module__": __name__})


@needs_drf
def test_a_subclass_that_moves_the_mixin_after_the_base_is_refused_too():
    from rest_framework.views import APIView

    from django_idempotency.drf import IdempotencyMixin

    class OwnMixin(IdempotencyMixin):
        """A project's own mixin over ours, not a view yet: accepted."""

    class Base(APIView):
        def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
            super().initial(request, *args, **kwargs)

    class Good(OwnMixin, Base):
        pass

    assert Good.__mro__.index(IdempotencyMixin) < Good.__mro__.index(APIView)
    with pytest.raises(ImproperlyConfigured, match="IdempotencyMixin must come before"):

        class Bad(Base, OwnMixin):
            pass


@needs_drf
def test_the_mixin_on_a_django_view_without_drf_is_refused():
    from django_idempotency.drf import IdempotencyMixin

    with pytest.raises(ImproperlyConfigured, match="DRF view"):

        class Plain(IdempotencyMixin, View):
            def post(self, request: HttpRequest) -> HttpResponse:
                return JsonResponse({}, status=201)


@needs_drf
def test_idempotent_above_api_view_is_refused():
    from rest_framework.decorators import api_view
    from rest_framework.response import Response

    @api_view(["POST"])
    def create(request: Any) -> Response:
        return Response({}, status=201)

    with pytest.raises(ImproperlyConfigured, match="beneath @api_view"):
        idempotent(create)
    with pytest.raises(ImproperlyConfigured, match="beneath @api_view"):
        idempotent(operation="x")(create)


@needs_drf
def test_idempotent_around_a_drf_views_as_view_is_refused():
    from rest_framework.response import Response
    from rest_framework.views import APIView

    class Create(APIView):
        def post(self, request: Any) -> Response:
            return Response({}, status=201)

    with pytest.raises(ImproperlyConfigured, match="IdempotencyMixin"):
        idempotent(Create.as_view())


def test_idempotent_on_a_class_is_refused():
    class Create(View):
        def post(self, request: HttpRequest) -> HttpResponse:
            return JsonResponse({}, status=201)

    with pytest.raises(ImproperlyConfigured, match="method_decorator"):
        idempotent(Create)


@needs_drf
def test_idempotent_straight_on_a_viewset_method_is_refused_where_it_is_written():
    from rest_framework import viewsets
    from rest_framework.response import Response

    with pytest.raises(ImproperlyConfigured, match="IdempotencyMixin first") as refused:

        class Charges(viewsets.ViewSet):
            @idempotent(operation="charges.create")
            def create(self, request: Any) -> Response:
                return Response({}, status=201)

    assert "Charges.create" in str(refused.value)


@pytest.mark.django_db
def test_idempotent_on_a_handler_whose_view_is_not_called_self_is_refused_when_called(rf):
    # A handler whose first parameter has another name is not known for one when it is
    # decorated: its first argument, the view, is refused when it arrives, and the handler
    # never runs.
    ran = []

    class Create(View):
        @idempotent
        def post(this, request: HttpRequest) -> HttpResponse:
            ran.append(request)
            return JsonResponse({}, status=201)

    request = rf.post("/", {}, content_type="application/json", headers={"Idempotency-Key": "k"})
    with pytest.raises(ImproperlyConfigured, match=r"method_decorator\(idempotent"):
        Create.as_view()(request)
    assert ran == []


def test_idempotent_above_classmethod_is_refused_as_a_method():
    # Not "its arguments are keyword arguments": a classmethod object is not callable.
    with pytest.raises(ImproperlyConfigured, match=r"method_decorator\(idempotent") as refused:

        class Views(View):
            @idempotent  # type: ignore[arg-type]
            @classmethod
            def create(cls, request: HttpRequest) -> HttpResponse:
                return JsonResponse({}, status=201)

    assert "Views.create" in str(refused.value)


@needs_ninja
@pytest.mark.parametrize("bare", [True, False], ids=["bare", "with-arguments"])
def test_djangos_idempotent_above_a_ninja_route_is_refused(bare):
    """Django's decorator above ``@api.post``: ninja serves the function it registered,
    which the decorator never wraps. Two POSTs with one key ran twice, and nothing said so."""
    import ninja

    api = ninja.NinjaAPI(urls_namespace=f"django-decorator-above-{bare}")

    @api.post("/charges")
    def create_charge(request: object) -> dict[str, int]:
        return {"id": 1}

    decorate = idempotent if bare else idempotent(operation="charges.create")
    with pytest.raises(ImproperlyConfigured, match=r"django_idempotency\.ninja"):
        decorate(create_charge)


@needs_ninja
@pytest.mark.parametrize("bare", [True, False], ids=["bare", "with-arguments"])
def test_djangos_idempotent_beneath_a_ninja_route_is_refused_where_the_route_is_built(bare):
    """Django's decorator beneath ``@api.post``: it gets the operation's answer (a dict, not
    a response) after the operation ran, and every request was a ``500`` whose work ran
    (its external calls made) and rolled back. Refused when ninja builds the operation."""
    import ninja

    api = ninja.NinjaAPI(urls_namespace=f"django-decorator-beneath-{bare}")
    ran: list[object] = []

    def create_charge(request: object) -> dict[str, int]:
        ran.append(request)
        return {"id": 1}

    decorated = idempotent(create_charge) if bare else idempotent(ttl=60)(create_charge)
    with pytest.raises(ImproperlyConfigured, match=r"django_idempotency\.ninja"):
        api.post("/charges")(decorated)
    assert ran == []
