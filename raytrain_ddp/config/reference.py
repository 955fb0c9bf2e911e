"""The configuration reference: every leaf key, its default and its description.

Owns: `config_keys` (frozen by a test so the public surface grows on purpose) and the
table that docs/configuration.md is generated from (`raytrain-ddp config --reference`,
tests/local/docs/gen_configuration.py; the page itself, with the `sweep:` section's keys, is
`sweep.reference_markdown`, so this module imports nothing of `sweep.py`, which reads it).
Must not touch: loading, validation.
"""

from __future__ import annotations

import yaml
from pydantic import BaseModel

from raytrain_ddp.config.schema import Config


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every leaf key, dotted; frozen by a test so the public surface grows on purpose."""
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(config_keys(ann, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def reference_table(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, description) for every leaf: the README's config reference is generated
    from this, so the documentation cannot drift from the schema."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(reference_table(ann, f"{prefix}{name}."))
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, tuple):
            default = list(default)
        rows.append((f"{prefix}{name}", yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip(),
                     (field.description or "").replace("\n", " ")))
    return rows
