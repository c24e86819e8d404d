"""A small kustomize renderer for the subset deploy/kubernetes/ uses, so its test needs no kustomize binary.

No kustomize or kubectl comes with the project (Debian's `kubernetes-client` is 1.20, without kustomize v5;
PyPI has none), so `render(dir)` builds a kustomization the way `kustomize build` does for these fields only:

- `resources`: YAML files (several documents each) and directories holding a kustomization (built first);
- `patches` (`path:` or inline `patch:`): strategic-merge patches, targeted by their kind and name; `null`
  deletes a field, `$patch: delete` deletes a list item (by its merge key) or, at the top, the whole object;
  lists merge by the keys below, every other list is replaced;
- `namespace`, `labels` (`pairs`, metadata only: no `includeSelectors`/`includeTemplates`), `images`
  (`name`, `newName`, `newTag`), applied after the patches as kustomize orders its transformers.

Anything else in a kustomization is an error, not silently ignored. Where a `kubectl` with kustomize is on
the PATH, the test compares this renderer's output with `kubectl kustomize`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_FIELDS = frozenset({"apiVersion", "kind", "resources", "patches", "namespace", "labels", "images"})
# The strategic-merge keys of the lists these manifests patch (Kubernetes' patchMergeKey for each field).
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
    "volumeMounts": "mountPath", "ports": "containerPort", "topologySpreadConstraints": "topologyKey",
}
CLUSTER_SCOPED = frozenset({"Namespace"})
PATCH = "$patch"

Object = dict[str, Any]


class KustomizeError(ValueError):
    pass


def load_documents(path: Path) -> list[Object]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: Path) -> list[Object]:
    """The objects `kustomize build directory` would print (in the order of the resources)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(f"{directory}/kustomization.yaml: fields this renderer does not know: {sorted(unknown)}")
    objects: list[Object] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects.extend(render(path) if path.is_dir() else load_documents(path))
    for patch in _patches(directory, kustomization.get("patches", [])):
        objects = apply_patch(objects, patch)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    for group in kustomization.get("labels", []):
        if set(group) - {"pairs"}:
            raise KustomizeError(f"{directory}: labels supports `pairs` only, got {sorted(group)}")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(group["pairs"])
    for image in kustomization.get("images", []):
        for obj in objects:
            _set_images(obj, image)
    return objects


def _patches(directory: Path, entries: list[Object]) -> list[Object]:
    patches = []
    for entry in entries:
        if set(entry) - {"path", "patch"}:
            raise KustomizeError(f"{directory}: patches support `path` or `patch` only, got {sorted(entry)}")
        text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
        documents = [doc for doc in yaml.safe_load_all(text) if doc]
        if len(documents) != 1:  # kustomize 5.5 itself crashes on several documents in one patch file
            raise KustomizeError(f"{directory}: one strategic-merge patch per entry, got {len(documents)}")
        patches.append(documents[0])
    return patches


def _identity(obj: Object) -> tuple[str, str, str]:
    group = obj["apiVersion"].rpartition("/")[0]
    return group, obj["kind"], obj["metadata"]["name"]


def apply_patch(objects: list[Object], patch: Object) -> list[Object]:
    matches = [i for i, obj in enumerate(objects) if _identity(obj) == _identity(patch)]
    if len(matches) != 1:
        raise KustomizeError(f"patch {_identity(patch)} matches {len(matches)} objects, not one")
    index = matches[0]
    if patch.get(PATCH) == "delete":
        return objects[:index] + objects[index + 1:]
    body = {key: value for key, value in patch.items() if key not in ("apiVersion", "kind")}
    merged = merge(objects[index], body)
    return objects[:index] + [merged] + objects[index + 1:]


def merge(target: Object, patch: Object) -> Object:
    """Strategic merge of `patch` into a copy of `target`."""
    result = copy.deepcopy(target)
    for key, value in patch.items():
        if key == PATCH:
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_list(result[key], value, MERGE_KEYS[key])
        else:
            result[key] = _strip(value)
    return result


def _merge_list(target: list[Object], patch: list[Object], merge_key: str) -> list[Object]:
    """As Kubernetes' strategic merge orders it: the patch's items first (merged or new), then the rest."""
    remaining = copy.deepcopy(target)
    head: list[Object] = []
    for item in patch:
        found = [existing for existing in remaining if existing.get(merge_key) == item.get(merge_key)]
        remaining = [existing for existing in remaining if existing.get(merge_key) != item.get(merge_key)]
        if item.get(PATCH) != "delete":
            head.append(merge(found[0], item) if found else _strip(item))
    return head + remaining


def _strip(value: Any) -> Any:
    """A patch's new value, without directives and null fields (they delete nothing that exists)."""
    if isinstance(value, dict):
        return {key: _strip(item) for key, item in value.items() if key != PATCH and item is not None}
    if isinstance(value, list):
        return [_strip(item) for item in value]
    return value


def _set_images(node: Any, image: Object) -> None:
    """kustomize's images transformer: every container's image whose name matches, wherever it sits."""
    if isinstance(node, list):
        for item in node:
            _set_images(item, image)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                container["image"] = _new_image(container["image"], image)
        _set_images(value, image)


def _new_image(current: str, image: Object) -> str:
    head, colon, tail = current.rpartition(":")
    name, tag = (head, tail) if colon and "/" not in tail else (current, "")  # host:port/name has no tag
    if name != image["name"]:
        return current
    tag = image.get("newTag", tag)
    return image.get("newName", name) + (f":{tag}" if tag else "")
