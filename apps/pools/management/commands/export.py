"""``python manage.py export [-o FILE] [--tenant SLUG] [--as USER]``: write tenants, pools and entitlements as manifests.

``--inference-objectives POOL [--inference-pool NAME] [--namespace NS]`` writes instead the InferenceObjective
manifests of an llm-d pool (one per service class: `apps.pools.manifests.objectives`)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.http import Http404

from apps.pools.management.commands._actor import resolve_actor
from apps.pools.manifests import manifests_export
from apps.pools.manifests.objectives import objectives_export
from apps.pools.models import K8S_NAME, BackendKind
from apps.pools.selectors import pool_get
from apps.tenancy.selectors import tenant_get


class Command(BaseCommand):
    help = "Export Tenant, TokenPool and TokenEntitlement manifests (multi-document YAML) that `apply` accepts."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("-o", "--output", help="file to write (default: standard output)")
        parser.add_argument("--tenant", help="only this tenant's entitlements and the pools they use")
        parser.add_argument("--as", dest="as_user", help="export what this user may see (default: everything)")
        parser.add_argument("--inference-objectives", metavar="POOL",
                            help="write instead the InferenceObjective manifests (one per service class) of this "
                            "pool, for the llm-d inference gateway in front of it")
        parser.add_argument("--inference-pool", metavar="NAME",
                            help="with --inference-objectives: the InferencePool their poolRef names (default: the "
                            "pool's name)")
        parser.add_argument("--namespace", help="with --inference-objectives: the namespace of the objectives")

    def handle(self, *args: Any, **options: Any) -> None:
        actor = resolve_actor(options["as_user"])
        if options["inference_objectives"] is not None:
            if options["tenant"]:
                raise CommandError("--tenant does not go with --inference-objectives (objectives are per pool)")
            self._write(self._objectives(actor, options), options["output"])
            return
        if options["inference_pool"] or options["namespace"]:
            raise CommandError("--inference-pool and --namespace go with --inference-objectives POOL")
        tenant = None
        if options["tenant"]:
            try:
                tenant = tenant_get(user=actor, slug=options["tenant"])
            except Http404 as exc:
                raise CommandError(f"unknown tenant {options['tenant']!r}") from exc
        self._write(manifests_export(user=actor, tenant=tenant), options["output"])

    def _objectives(self, actor: Any, options: dict[str, Any]) -> str:
        name = options["inference_objectives"]
        try:
            pool = pool_get(user=actor, name=name)
        except Http404 as exc:
            raise CommandError(f"unknown pool {name!r}") from exc
        if pool.backend_kind != BackendKind.LLM_D:
            # Still written: the objectives are what the pool would get once its backend is llm-d.
            self.stderr.write(f"note: pool {pool.name!r} has backend kind {pool.backend_kind!r}, not 'llm-d': "
                              "the gateway sends these objectives only to an llm-d backend")
        ref = options["inference_pool"]
        if ref is not None and not K8S_NAME.match(ref):
            raise CommandError(f"--inference-pool {ref!r} is not a Kubernetes object name")
        return objectives_export(pool, inference_pool=options["inference_pool"], namespace=options["namespace"])

    def _write(self, text: str, output: str | None) -> None:
        if output:
            try:
                with open(output, "w", encoding="utf-8") as fh:
                    fh.write(text)
            except OSError as exc:
                raise CommandError(f"cannot write {output}: {exc.strerror}") from exc
        else:
            self.stdout.write(text, ending="")
