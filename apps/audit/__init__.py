"""The audit log: who changed which tenant, membership, user role, pool, replica, entitlement, quota or API key,
when, through what way in, and the fields before and after (``AuditEntry``).

Entries are written by model signals (``apps.audit.recorder``) inside the transaction of the change itself, so a
change and its entry commit or roll back together (a dry run records nothing). Who and through what come from
``apps.audit.context``: set per HTTP request by ``apps.audit.middleware.AuditMiddleware`` and by the management
commands; nothing set means ``system``. Control loops' bookkeeping (usage, scrapes, binding state, a key's
``last_used_at``) is not a change by a person and is not recorded.
"""
