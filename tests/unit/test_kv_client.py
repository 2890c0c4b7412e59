"""The worker side's pure helpers (no processes)."""

from __future__ import annotations

import pytest

from trainer.kv.client import KeyInfo, wd_mult_to_ids, wd_mult_to_keys
from trainer.kv.errors import KVConfigError
from trainer.kv.placement import Part

KEYS = {"fc1_weight": KeyInfo(0, 1, 4, [Part(0, 0, 0, 4)]),
        "fc1_bias": KeyInfo(1, 1, 2, [Part(0, 0, 0, 2)]),
        7: KeyInfo(2, 1, 2, [Part(0, 0, 0, 2)])}


def test_wd_mult_travels_as_key_ids_and_comes_back_as_keys() -> None:
    spec = {"name": "sgd", "wd": 0.1, "wd_mult": {"fc1_bias": 0.0, "7": 2.0}}
    sent = wd_mult_to_ids(spec, KEYS)
    assert sent["wd_mult"] == {"1": 0.0, "2": 2.0}
    assert spec["wd_mult"] == {"fc1_bias": 0.0, "7": 2.0}  # the caller's spec is untouched
    assert wd_mult_to_keys(sent, KEYS)["wd_mult"] == {"fc1_bias": 0.0, "7": 2.0}
    assert wd_mult_to_ids({"name": "sgd", "wd_mult": {}}, KEYS) == {"name": "sgd", "wd_mult": {}}


def test_wd_mult_for_a_key_not_initialised_is_a_one_line_error() -> None:
    with pytest.raises(KVConfigError, match="wd_mult names key 'conv_bias', which is not "
                                            "initialised") as e:
        wd_mult_to_ids({"name": "sgd", "wd_mult": {"conv_bias": 0.0}}, KEYS)
    assert "\n" not in str(e.value)
