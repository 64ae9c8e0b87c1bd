"""The shop's URLs: ``orders/`` (the project mounts them under ``shop/``)."""

from __future__ import annotations

from rest_framework.routers import SimpleRouter

from example_project.docs_examples.shop.views import OrderViewSet

router = SimpleRouter()
router.register("orders", OrderViewSet, basename="order")

urlpatterns = router.urls
