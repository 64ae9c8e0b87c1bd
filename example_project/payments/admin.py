from __future__ import annotations

from django.contrib import admin

from example_project.payments.models import (
    Charge,
    ProviderCall,
    ProviderCharge,
    Refund,
    Ride,
    SentMail,
)


class RefundInline(admin.TabularInline):  # type: ignore[type-arg]
    model = Refund
    extra = 0
    readonly_fields = ["amount", "reason", "created_at"]


@admin.register(Charge)
class ChargeAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "user", "amount", "currency", "provider_charge_id", "created_at"]
    list_filter = ["currency"]
    search_fields = ["provider_charge_id", "description", "user__username"]
    date_hierarchy = "created_at"
    inlines = [RefundInline]


@admin.register(Refund)
class RefundAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "charge", "amount", "reason", "created_at"]
    date_hierarchy = "created_at"


@admin.register(ProviderCharge)
class ProviderChargeAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["reference", "amount", "currency", "description", "created_at"]
    search_fields = ["reference", "key", "description"]


@admin.register(ProviderCall)
class ProviderCallAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "key", "description", "created_at"]
    search_fields = ["key", "description"]


@admin.register(Ride)
class RideAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "user", "origin", "target", "amount", "currency", "provider_charge_id"]
    search_fields = ["origin", "target", "provider_charge_id", "user__username"]
    date_hierarchy = "created_at"


@admin.register(SentMail)
class SentMailAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["id", "recipient", "subject", "created_at"]
    search_fields = ["recipient", "subject"]
