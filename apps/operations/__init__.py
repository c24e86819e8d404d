"""Operations that span apps: one layer above `apps.tenancy` and `apps.pools` (a plain package, not an app).

Pools depend on tenancy (an entitlement belongs to a tenant), so tenancy cannot call pools without a
cycle. What needs both lives here, calling the services and selectors of each (zulip's `zerver/actions`,
the HackSoft style guide's services), and the REST endpoints that need both sit beside it:

tenants.py      `tenant_save` (and `tenant_delete`, from apps.pools.services: the one tenant delete).
serializers.py  `ApiKeySerializer`: an API key names an entitlement (pools) the requesting user may see.
api.py          `TenantViewSet` (its delete is `tenant_delete`) and `ApiKeyViewSet` (/api/v1/tenants, /keys).

import-linter holds the layers (pyproject.toml): operations above pools above tenancy, and tenancy never
imports pools.
"""
