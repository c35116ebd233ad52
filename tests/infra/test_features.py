"""SM120 features, computed from the installed code, against the lock's expectations. A feature the lock
expects to be unavailable passes when it is, and the report says why in plain words."""

from __future__ import annotations

import pytest

FEATURES = ["torch_symm_mem_allreduce", "flashinfer_allreduce_fusion"]


@pytest.mark.parametrize("feature", FEATURES)
def test_feature_state_is_what_the_lock_expects(facts, env, profile, feature, record_property):
    expected = profile.expect.features.get(feature)
    if expected is None:
        pytest.skip(f"profile {profile.name} states no expectation for {feature}")
    report = facts["features"][feature]
    record_property("note", f"{feature}: {report['state']}: {report['reason']}")
    assert report["state"] == expected, (
        f"{feature} is {report['state'].upper()} on SM{facts['capability'].replace('.', '')}, the lock expects "
        f"{expected}: {report['reason']}"
        + (
            " Apply the patch: `bwstack patch apply`."
            if report["state"] == "crashes" and feature.startswith("torch")
            else ""
        )
    )
