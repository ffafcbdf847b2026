"""Rollouts on Ray through TorchRL's RayLLMCollector (ar_torchrl.interop.ray), on a real local Ray
cluster: a head node and two one-CPU worker nodes (three raylets on this machine), one worker on
each, real TorchRL envs and TransformersWrapper engines (examples/torchrl_ray_critic.py's factories).

- the engines sample, with greedy decoding (deterministic), exactly what one process's
  LLMCollector samples from the learner's weights, before and after a PPO update published over
  the dedicated weight group (never ``value_head.*``); batches carry the learner's version;
- an FSDP2 learner on two ranks publishes from rank 0 (its lazily gathered FullTensorStream);
- a killed worker is named and stops the rollout; the other worker's process ends;
- the example's one command (``--local-cluster``) trains two iterations, ratio exactly 1;
- nothing outlives a test: every process started by it is found by an environment marker that Ray's
  processes inherit, and must be gone.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="the [ray] extra (pip install 'ar_torchrl[ray]')")
# no usage report to Ray's servers from a test (CI has no network); inherited by every Ray process
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from support.dist_workers import (  # noqa: E402
    engine_weights,
    ray_example,
    ray_learner_model,
    ray_rollout,
)

from ar_torchrl.interop.ray import RayRollout, RolloutWorkerLost, local_cluster  # noqa: E402
from ar_torchrl.models.tiny import build_tiny_qwen3  # noqa: E402
from ar_torchrl.modules import attach_value_head  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torchrl_ray_critic.py"
MARK = "AR_TORCHRL_RAY_TEST_MARK"


def _marked(mark: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``MARK=mark``, this one excluded."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def _wait_gone(pids, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


@pytest.fixture(scope="module")
def cluster():
    """A local cluster (head without CPUs + two one-CPU nodes); afterwards no process it started
    may be left."""
    from multiprocessing import resource_tracker

    # Python's resource tracker (shared by this process's spawns, e.g. the 2-rank learner below)
    # lives as long as this process: started before the marker is set, it does not carry it
    resource_tracker.ensure_running()
    mark = uuid.uuid4().hex
    os.environ[MARK] = mark  # inherited by the raylets, GCS and every worker process
    try:
        with local_cluster(2) as c:
            ray_example()  # its factories pickled by value for the workers
            assert len(_marked(mark)) >= 3  # the marker does reach Ray's processes
            yield c
    finally:
        os.environ.pop(MARK, None)
    left = _wait_gone(_marked(mark))
    assert left == [], [_cmdline(p) for p in left]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


# -- TorchRL 0.14.1's RayLLMCollector, as this module relies on it ---------------------------------


def test_ray_llm_collector_takes_a_weight_updater_and_no_scheme_and_keeps_its_actor_handle():
    """If TorchRL adds ``weight_sync_schemes`` to RayLLMCollector, GroupWeightReceiver should become
    a scheme (module docstring); ``_actor`` reads the handle TorchRL keeps as ``_collector``."""
    from torchrl.collectors.llm import RayLLMCollector

    params = inspect.signature(RayLLMCollector.__init__).parameters
    assert "weight_updater" in params and "weight_sync_schemes" not in params
    assert "self._collector = remote_cls(" in inspect.getsource(RayLLMCollector.__init__)


def test_the_receiver_is_a_weight_updater_that_ships_no_runtime_state():
    import pickle

    from torchrl.collectors import WeightUpdaterBase

    from ar_torchrl.interop.ray import GroupWeightReceiver

    receiver = GroupWeightReceiver()
    receiver._buffers = [torch.zeros(3)]
    receiver._engine = object()
    copy = pickle.loads(pickle.dumps(receiver))
    assert isinstance(copy, WeightUpdaterBase)
    assert (copy._buffers, copy._engine, copy._group) == (None, None, None)


def test_ray_rollout_checks_its_arguments():
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        RayRollout(print, print, num_workers=0, dialog_turns_per_batch=1)


# -- on the local cluster ----------------------------------------------------------------------------


def _local_collector(worker: int):
    """One process's TorchRL loop for worker ``worker``: its env, a greedy engine, LLMCollector."""
    from torchrl.collectors.llm import LLMCollector

    from ar_torchrl.interop import TokenTrajectory
    from ar_torchrl.models import build_char_tokenizer

    ex = ray_example()
    env = ex.make_env(worker, prompts_per_batch=2, group_size=2, seed=0)
    policy = ex.make_policy(max_new_tokens=6, greedy=True)
    collector = LLMCollector(
        env,
        policy=policy,
        dialog_turns_per_batch=4,
        postproc=TokenTrajectory(build_char_tokenizer(), max_new_tokens=6),
        track_policy_version=True,
    )
    return collector, policy


def _load(policy, model) -> None:
    from ar_torchrl.weight_sync import named_policy_tensors

    with torch.no_grad():
        state = dict(named_policy_tensors(model))
        missing, unexpected = policy.model.load_state_dict(state, strict=False)
        assert unexpected == [] and set(missing) <= {"lm_head.weight"}


def _assert_engines_hold(rollout, model) -> None:
    """Every worker's engine holds the learner's policy tensors, bit for bit (a copy)."""
    from ar_torchrl.weight_sync import named_policy_tensors

    want = dict(named_policy_tensors(model))
    for got in rollout.run_on_workers(engine_weights):
        assert set(want) <= set(got)
        assert all(torch.equal(got[name], t) for name, t in want.items())


def _same_samples(a, b) -> None:
    assert a.batch_size == b.batch_size
    for key in ("tokens", "attention_mask", "loss_mask", ("next", "reward")):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_workers_on_two_nodes_sample_what_one_process_samples_before_and_after_an_update(cluster):
    from ar_torchrl.modules import LMActorCritic
    from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
    from ar_torchrl.training import (
        plan_micro_batches,
        ppo_update,
        recompute_old_log_probs_and_values,
    )
    from ar_torchrl.weight_sync import named_policy_tensors

    torch.set_num_threads(1)
    model = attach_value_head(ray_learner_model())
    with ray_rollout() as rollout:
        assert len(set(rollout.nodes)) == 2  # one worker per node
        publisher = rollout.connect(named_policy_tensors(model))
        assert not any(name.startswith("value_head") for name, _, _ in publisher.spec)
        assert any(name.startswith("value_head") for name, _ in model.named_parameters())
        assert [s[0] for s in publisher.spec] == [n for n, _ in named_policy_tensors(model)]
        _assert_engines_hold(rollout, model)
        first = rollout.collect_each()

        local = [_local_collector(i) for i in range(2)]
        unsynced = [next(iter(c)) for c, _ in local]  # the engines' own weights: other samples
        assert any(not torch.equal(u["tokens"], f["tokens"]) for u, f in zip(unsynced, first))
        for collector, _ in local:
            collector.shutdown()
        local = [_local_collector(i) for i in range(2)]  # fresh envs: the same prompts again
        for _, policy in local:
            _load(policy, model)
        for (collector, _), got in zip(local, first):
            _same_samples(next(iter(collector)), got)
            assert got["policy_version"].unique().tolist() == [0]

        # one PPO update of the learner (critic and policy), then the push as version 1
        data = rollout._collate(first)
        actor_critic = LMActorCritic(model)
        plan = plan_micro_batches(data, token_budget=256)
        recompute_old_log_probs_and_values(actor_critic, data, plan)
        TokenGAE(gamma=1.0, lmbda=0.95)(data)
        loss = TokenPPOLoss(actor_critic, clip_epsilon=0.2, clip_value=0.2)
        before = model.lm_head.weight.detach().clone()
        ppo_update(loss, torch.optim.AdamW(loss.parameters(), lr=1e-2), data, plan, epochs=1)
        assert not torch.equal(before, model.lm_head.weight)
        rollout.publish(named_policy_tensors(model), version=1)
        assert rollout.policy_versions == [1, 1]
        _assert_engines_hold(rollout, model)
        second = rollout.collect_each()
        for (collector, policy), got in zip(local, second):
            _load(policy, model)
            _same_samples(next(iter(collector)), got)
            assert got["policy_version"].unique().tolist() == [1]
        for collector, _ in local:
            collector.shutdown()
        merged = rollout.collect()  # both workers' next batches, one trajectory
        assert merged.batch_size[0] == 8 and merged["loss_mask"].any(1).all()


@pytest.mark.slow
def test_a_killed_worker_is_named_and_the_rollout_stops(cluster):
    rollout = ray_rollout()
    pids = list(rollout.pids)
    assert len(set(rollout.nodes)) == 2 and all(_state(p) not in ("X", "Z") for p in pids)
    rollout.collect_each()  # both work
    os.kill(pids[1], signal.SIGKILL)
    node = rollout.nodes[1]
    with pytest.raises(
        RolloutWorkerLost, match=rf"rollout worker 1 \(Ray node {node}\) is lost: \w*ActorDiedError"
    ) as info:
        rollout.collect_each()
    assert (info.value.worker, info.value.node) == (1, node)
    assert _wait_gone(pids) == []  # the surviving worker was shut down too
    with pytest.raises(RuntimeError, match="RayRollout is shut down"):
        rollout.collect_each()


@pytest.mark.slow
def test_a_push_that_does_not_match_the_spec_is_refused_and_stops_the_rollout(cluster):
    from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

    model = attach_value_head(ray_learner_model())
    rollout = ray_rollout()
    pids = list(rollout.pids)
    rollout.connect(named_policy_tensors(model))
    tensors = list(named_policy_tensors(model))
    renamed = [("model.bogus.weight", tensors[0][1]), *tensors[1:]]
    start = time.monotonic()
    with pytest.raises(
        WeightSyncError,
        match=r"tensor 0 is 'model.bogus.weight' \(99, 64\), the spec's is \('model.embed_tokens.weight', \(99, 64\)\)",
    ):
        rollout.publish(renamed, version=1)
    assert time.monotonic() - start < 60  # not the weight group's 300 s timeout
    assert _wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="RayRollout is shut down"):
        rollout.collect_each()


@pytest.mark.slow
def test_an_engine_of_another_architecture_is_refused_and_named(cluster):
    """At connect (before any worker joins the weight group: no wait in its rendezvous) a learner
    of another architecture is refused naming the worker and the shapes, the workers usable;
    after it, a worker whose engine refuses a push is named with the engine's reason (an error
    inside a worker reaches the learner: TorchRL's collector __len__ workaround) and the rollout
    stops."""
    from support.dist_workers import collector_is_truthy, shrink_engine
    from torchrl.collectors.llm import LLMCollector

    from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

    # TorchRL 0.14.1: a non-terminating collector cannot be tested for truth (its __len__ is
    # inf); RayRollout's workers are sized finite (ar_torchrl/interop/ray.py). When this fails,
    # TorchRL fixed it and the workaround can go.
    ex = ray_example()
    env, policy = (
        ex.make_env(0, prompts_per_batch=2, group_size=2, seed=0),
        ex.make_policy(max_new_tokens=6, greedy=True),
    )
    with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
        bool(LLMCollector(env, policy=policy, dialog_turns_per_batch=4))
    model = attach_value_head(ray_learner_model())
    rollout = ray_rollout()
    pids = list(rollout.pids)
    assert rollout.run_on_workers(collector_is_truthy) == [True, True]
    other = build_tiny_qwen3(99, hidden_size=32, num_heads=2, seed=7)
    start = time.monotonic()
    with pytest.raises(
        WeightSyncError,
        match=r"worker 0's model and the learner's policy differ \(learner-only tensors \[\], "
        r"worker-only \[\], shapes \(name, learner, worker\) \[\('model.embed_tokens.weight', "
        r"\(99, 32\), \(99, 64\)\)",
    ):
        rollout.connect(named_policy_tensors(other))
    assert time.monotonic() - start < 30
    assert rollout.collect_each()[0]["tokens"].shape[0] == 4
    rollout.connect(named_policy_tensors(model))
    rollout.run_on_workers(shrink_engine)
    with pytest.raises(
        WeightSyncError,
        match=r"worker 0 failed to load version 1: .*StrategySender: tensor "
        r"'model.embed_tokens.weight' has shape \(99, 64\), the engine's model \(99, 32\).*; the "
        r"rollout was stopped",
    ):
        rollout.publish(named_policy_tensors(model), version=1)
    assert _wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="RayRollout is shut down"):
        rollout.collect_each()


@pytest.mark.slow
def test_the_example_runs_on_a_local_cluster_and_leaves_nothing_behind(tmp_path):
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--local-cluster", "--workers", "2", "--iterations", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("iter")]
    assert len(lines) == 2, out.stdout[-2000:]
    assert "versions [0, 0]" in lines[0] and "versions [1, 1]" in lines[1]
    assert all("ratio min 1.0 max 1.0" in line and "rows 16" in line for line in lines)
    assert _wait_gone(_marked(mark)) == []


@pytest.mark.slow
def test_an_fsdp2_learner_on_two_ranks_publishes_from_rank_0(cluster, tmp_path, monkeypatch):
    """The learner as torchrun-style ranks (2 gloo ranks, FSDP2): rank 0 drives the rollout and
    publishes its lazily all-gathered tensors, rank 1 only takes part in the gathers; the workers'
    engines then hold the full policy bit for bit, and the learner's own group is untouched."""
    import json

    from safetensors.torch import load_file
    from support.dist_workers import RAY_ADDRESS_ENV, ray_publish_checks, spawn

    monkeypatch.setenv(RAY_ADDRESS_ENV, cluster.address)
    spawn(ray_publish_checks, 2, tmp_path, timeout_s=600)
    v0, v1 = (json.loads((tmp_path / f"ray_v{v}.json").read_text()) for v in (0, 1))
    assert v0 == {"versions": [0, 0], "nodes": 2, "equal": [True, True], "value_head_sent": False}
    assert v1 == {"versions": [1, 1], "nodes": 2, "equal": [True, True], "value_head_sent": False}
    w0, w1 = (load_file(str(tmp_path / f"ray_v{v}.safetensors")) for v in (0, 1))
    assert all(torch.equal(w1[n], 1.5 * w0[n]) for n in w0)  # the second push carried new weights
    assert json.loads((tmp_path / "ray_default_group.json").read_text()) == {"sum": 2.0}
