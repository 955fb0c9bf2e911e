"""Property: any override is either accepted or rejected with a message naming its key.

Never an unhandled traceback from deep inside: users see one line that tells them what
to fix (issue #6, item 8).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raytrain_ddp.config import Config, ConfigError, config_keys, load_config

pytestmark = pytest.mark.timeout(120)

KEYS = config_keys() + ["bogus", "train.bogus", "model.name.deeper", "scaling", "data.synthetic"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["mlp", "cnn", "gpt", "bf16", "fp16", "parquet", "digits", "synthetic", "naive",
                     "bucketed", "native", "exact", "streaming", "latest", "skip", "abort", "sgd"]),
    st.text(max_size=12),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars, max_size=2))


def _as_yaml(value) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=3))
def test_overrides_are_accepted_or_name_a_key(pairs):
    overrides = [f"{key}={_as_yaml(value)}" for key, value in pairs]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as err:
        message = str(err)
        assert message.strip(), overrides
        named = [key for key, _ in pairs if key in message]  # the whole dotted key, not a section's name
        assert named, f"{overrides!r} -> {message!r} names none of the keys"
        return
    assert isinstance(cfg, Config)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=30))
def test_raw_override_strings_never_crash(raw):
    try:
        load_config(None, [raw])
    except ConfigError as err:
        assert str(err).strip()
