"""Optimizers from JSON specs: MXNet semantics, schedulers, validation, numpy/torch parity."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from trainer.kv.optim import (
    FactorScheduler,
    MultiFactorScheduler,
    OptimizerError,
    Updater,
    create_optimizer,
)
from trainer.kvbase import TORCH_OPS


def run(spec: dict, grads: list[np.ndarray], w0: np.ndarray) -> np.ndarray:
    up = Updater(create_optimizer(spec))
    w = w0.astype(np.float64).copy()
    for g in grads:
        up("k", w, g.astype(np.float64).copy())
    return w


def test_sgd_plain_and_weight_decay() -> None:
    w = run({"name": "sgd", "learning_rate": 0.1, "wd": 0.5, "rescale_grad": 0.5},
            [np.array([2.0, -4.0])], np.array([1.0, 1.0]))
    # w - lr * (rescale * g + wd * w)
    np.testing.assert_allclose(w, [1 - 0.1 * (1 + 0.5), 1 - 0.1 * (-2 + 0.5)])


def test_wd_mult_scales_weight_decay_per_key() -> None:
    up = Updater(create_optimizer({"name": "sgd", "learning_rate": 0.1, "wd": 0.5,
                                   "wd_mult": {"bias": 0.0, "7": 2.0}}))
    w_bias, w_7, w_other = np.ones(2), np.ones(2), np.ones(2)
    up("bias", w_bias, np.zeros(2))
    up(7, w_7, np.zeros(2))  # integer keys match their string form
    up("other", w_other, np.zeros(2))
    np.testing.assert_allclose(w_bias, [1.0, 1.0])
    np.testing.assert_allclose(w_7, [1 - 0.1 * 2 * 0.5] * 2)
    np.testing.assert_allclose(w_other, [1 - 0.1 * 0.5] * 2)


def test_sgd_momentum_matches_mxnet_recurrence() -> None:
    lr, mu, wd = 0.05, 0.9, 1e-3
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=5) for _ in range(6)]
    w_ref, mom = np.ones(5), np.zeros(5)
    for g in grads:
        mom = mu * mom - lr * (g + wd * w_ref)
        w_ref = w_ref + mom
    got = run({"name": "sgd", "learning_rate": lr, "momentum": mu, "wd": wd}, grads, np.ones(5))
    np.testing.assert_allclose(got, w_ref, rtol=1e-12)


def test_clip_gradient_applies_after_rescale() -> None:
    w = run({"name": "sgd", "learning_rate": 1.0, "rescale_grad": 10.0, "clip_gradient": 1.0},
            [np.array([0.05, 5.0, -5.0])], np.zeros(3))
    np.testing.assert_allclose(w, [-0.5, -1.0, 1.0])


def test_nag_matches_mxnet_1x() -> None:
    lr, mu = 0.1, 0.9
    grads = [np.array([1.0, -2.0]), np.array([0.5, 0.5]), np.array([-1.0, 3.0])]
    w_ref, mom = np.array([1.0, 2.0]), np.zeros(2)
    for g in grads:
        mom = mu * mom + g
        w_ref = w_ref - lr * (g + mu * mom)
    got = run({"name": "nag", "learning_rate": lr, "momentum": mu}, grads, np.array([1.0, 2.0]))
    np.testing.assert_allclose(got, w_ref, rtol=1e-12)


def test_adam_matches_bias_corrected_reference() -> None:
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.01
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=4) for _ in range(5)]
    w_ref, m, v = np.ones(4), np.zeros(4), np.zeros(4)
    for t, g in enumerate(grads, 1):
        g = g + wd * w_ref
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        lr_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        w_ref = w_ref - lr_t * m / (np.sqrt(v) + eps)
    got = run({"name": "adam", "learning_rate": lr, "wd": wd}, grads, np.ones(4))
    np.testing.assert_allclose(got, w_ref, rtol=1e-10)


def test_schedulers_follow_mxnet_num_update() -> None:
    ms = MultiFactorScheduler({"name": "multifactor", "step": [3, 5], "factor": 0.1}, 1.0)
    assert [round(ms(n), 6) for n in range(1, 8)] == [1, 1, 1, 0.1, 0.1, 0.01, 0.01]
    fs = FactorScheduler({"name": "factor", "step": 2, "factor": 0.5, "stop_factor_lr": 0.2}, 1.0)
    assert [fs(n) for n in range(1, 8)] == [1, 1, 0.5, 0.5, 0.25, 0.25, 0.2]


def test_lr_scheduler_counts_updates_per_updater() -> None:
    spec = {"name": "sgd", "learning_rate": 1.0,
            "lr_scheduler": {"name": "multifactor", "step": [1], "factor": 0.5}}
    up = Updater(create_optimizer(spec))
    w = np.zeros(1)
    up("a", w, np.ones(1))      # num_update 1: lr 1
    up("b", w, np.ones(1))      # key b count 1, num_update stays 1: lr 1
    up("a", w, np.ones(1))      # num_update 2 > 1: lr 0.5
    np.testing.assert_allclose(w, [-2.5])
    assert up.num_update == 2 and up.counts == {"a": 2, "b": 1}


def test_states_round_trip_resumes_exactly() -> None:
    spec = {"name": "adam", "learning_rate": 0.1}
    rng = np.random.default_rng(2)
    grads = [rng.normal(size=3) for _ in range(4)]
    full = run(spec, grads, np.ones(3))
    up = Updater(create_optimizer(spec))
    w = np.ones(3)
    for g in grads[:2]:
        up("k", w, g.copy())
    saved = {k: (c, {n: a.copy() for n, a in s.items()}) for k, (c, s) in up.get_states().items()}
    resumed = Updater(create_optimizer(spec))
    resumed.set_states(saved)
    for g in grads[2:]:
        resumed("k", w, g.copy())
    np.testing.assert_allclose(w, full, rtol=1e-12)


@pytest.mark.parametrize("name", ["sgd", "nag", "adam"])
def test_numpy_and_torch_agree(name: str) -> None:
    spec = {"name": name, "learning_rate": 0.05, "wd": 1e-3, "rescale_grad": 0.25,
            "clip_gradient": 2.0}
    if name != "adam":
        spec["momentum"] = 0.9
    rng = np.random.default_rng(3)
    grads = [rng.normal(size=(3, 4)).astype(np.float32) for _ in range(4)]
    w_np = np.ones((3, 4), np.float32)
    w_t = torch.ones(3, 4)
    up_np, up_t = Updater(create_optimizer(spec)), Updater(create_optimizer(spec), TORCH_OPS)
    for g in grads:
        up_np(0, w_np, g.copy())
        up_t(0, w_t, torch.from_numpy(g.copy()))
    np.testing.assert_allclose(w_t.numpy(), w_np, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [
    {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9, "wd": 1e-3, "rescale_grad": 0.25,
     "wd_mult": {"b": 0.0}, "lr_scheduler": {"name": "multifactor", "step": [2], "factor": 0.1}},
    {"name": "sgd", "learning_rate": 0.05, "wd": 1e-3, "rescale_grad": 0.25, "wd_mult": {"b": 0.0}},
    {"name": "sgd", "learning_rate": 0.05, "momentum": 0.5, "rescale_grad": 2.0, "clip_gradient": 0.3},
    {"name": "adam", "learning_rate": 0.01, "wd": 1e-3},  # no multi-tensor step: one key at a time
], ids=["momentum-wd-schedule", "plain-wd", "clip", "adam"])
def test_a_multi_tensor_step_matches_one_key_at_a_time(spec: dict) -> None:
    rng = np.random.default_rng(5)
    keys = ["w", "b", "v"]
    shapes = [(5, 3), (5,), (2, 2)]
    fused = [torch.ones(s) for s in shapes]
    single = [torch.ones(s) for s in shapes]
    up_fused = Updater(create_optimizer(spec), TORCH_OPS)
    up_single = Updater(create_optimizer(spec), TORCH_OPS)
    for _ in range(4):
        grads = [torch.from_numpy(rng.normal(size=s).astype(np.float32)) for s in shapes]
        kept = [g.clone() for g in grads]
        up_fused.update_many(keys, fused, grads)
        assert all(torch.equal(g, k) for g, k in zip(grads, kept))  # gradients only read
        for k, w, g in zip(keys, single, grads):
            up_single(k, w, g.clone())
    for a, b in zip(fused, single):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert up_fused.counts == up_single.counts and up_fused.num_update == up_single.num_update
    for k in keys:
        for name, st in up_single.states[k].items():
            torch.testing.assert_close(up_fused.states[k][name], st, rtol=1e-6, atol=1e-7)


def test_a_key_twice_in_one_local_push_steps_twice() -> None:
    from trainer import kvstore

    kv = kvstore.create("local")
    kv.init("w", torch.zeros(2))
    kv.set_optimizer({"name": "sgd", "learning_rate": 1.0, "momentum": 0.5})
    kv.push(["w", "w"], [torch.ones(2), torch.ones(2)])
    out = torch.empty(2)
    kv.pull("w", out)
    # mom1 = -1, w1 = -1; mom2 = -0.5 - 1 = -1.5, w2 = -2.5
    assert out.tolist() == [-2.5, -2.5]


def test_spec_round_trips_through_json() -> None:
    spec = {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9, "wd": 1e-4,
            "wd_mult": {"1": 0.0}, "rescale_grad": 1 / 128, "clip_gradient": None,
            "lr_scheduler": {"name": "multifactor", "step": [938, 1876], "factor": 0.1}}
    opt = create_optimizer(spec)
    again = create_optimizer(json.loads(json.dumps(opt.to_spec())))
    assert again.to_spec() == opt.to_spec()
    assert opt.lr(939) == pytest.approx(0.005)


@pytest.mark.parametrize("spec, message", [
    ({"name": "rmsprop"}, "unknown optimizer 'rmsprop'; known: sgd, nag, adam"),
    ("sgd", "must be a dict"),
    ({"name": "sgd", "mom": 0.9}, "unknown option 'mom'"),
    ({"name": "sgd", "learning_rate": "fast"}, "learning_rate='fast' must be a finite number"),
    ({"name": "sgd", "learning_rate": -1}, "must be at least 0"),
    ({"name": "adam", "momentum": 0.9}, "unknown option 'momentum'"),
    ({"name": "sgd", "wd_mult": [0.0]}, "wd_mult must be a dict"),
    ({"name": "sgd", "wd_mult": {"3": -1}}, "wd_mult: 3=-1 must be at least 0"),
    ({"name": "sgd", "lr_scheduler": {"name": "cosine"}}, "unknown lr_scheduler 'cosine'"),
    ({"name": "sgd", "lr_scheduler": {"name": "multifactor", "step": [5, 3]}}, "strictly increasing"),
    ({"name": "sgd", "lr_scheduler": {"name": "multifactor", "step": []}}, "non-empty list"),
    ({"name": "sgd", "lr_scheduler": {"name": "factor", "step": 0}}, "integer >= 1"),
    ({"name": "sgd", "lr_scheduler": {"name": "factor", "step": 5, "factor": 2}}, "at most 1"),
])
def test_bad_specs_give_one_line_errors(spec: object, message: str) -> None:
    with pytest.raises(OptimizerError, match=message.replace("(", r"\(")) as e:
        create_optimizer(spec)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)
