"""Hydra configs: typed schemas (one per config group option), every key commented, every bad value
rejected before anything is built (naming the key), and the GPU recipe instantiated up to the GPU."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from support.recipe_helpers import CONFIGS, ROOT, typed
from support.recipe_helpers import load as _load

from ar_torchrl.backends.sglang.config import SGLangBackendConfig
from ar_torchrl.backends.transformers.config import TrainsideBackendConfig
from ar_torchrl.data.datasets import ArithmeticDataConfig, DapoMathDataConfig
from ar_torchrl.models.config import PretrainedModelConfig, SmolLM2ModelConfig, TinyModelConfig
from ar_torchrl.recipes.dapo_ppo import config as recipe_config


def recipe_module():
    from ar_torchrl.recipes.dapo_ppo import build  # torch, transformers, TorchRL

    return build


def load(name: str = "dapo_ppo", overrides: list[str] | None = None):
    return _load(overrides or [], name)


def test_every_key_is_commented():
    files = sorted(CONFIGS.rglob("*.yaml"))
    assert len(files) >= 14
    missing = []
    for f in files:
        for no, line in enumerate(f.read_text().splitlines(), 1):
            if re.match(r"^\s*[A-Za-z_][\w]*:", line) and "#" not in line:
                if line.strip() != "defaults:":
                    missing.append(f"{f.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not missing, "uncommented keys:\n" + "\n".join(missing)


#: What a config comment must not quote: measured figures belong in docs/ (STYLE.md rule 13).
MEASUREMENT = re.compile(
    r"\d\s?%"  # percentages
    r"|\d(\.\d+)?x\b"  # speed-ups: 1.9x, 0.74x
    r"|\b(faster|slower|measured|speed-?up)\b"
    r"|\bs\s?/\s?it(eration)?\b|\bseconds? per\b"  # s/iteration
    r"|\b\d+(\.\d+)?\s?(min|minutes|hours?|ms|GB|GiB|MB|MiB)\b"  # times and sizes
    r"|\b\d+ of \d+\b",  # counts: "0 of 16"
    re.I,
)


def yaml_comment(line: str) -> str:
    """The comment of a config line ('' for none): a whole-line comment or a trailing ``  # ...``."""
    if line.lstrip().startswith("#"):
        return line.lstrip()
    return line[line.index(" #") + 1 :] if " #" in line else ""


@pytest.mark.parametrize(
    "line",
    [
        "  packing: auto            # (CPU: 1.3-1.9x faster at 28-43 % padding)",
        "  packing: false           # packed micro-batches measured 0.74x the speed of padded ones",
        "  iterations: 10           # ~1 min each on a quiet core",
        "  shots: 2                 # (with one: greedy call rate 0 of 16)",
        "# one run takes 1.20 s/iteration",
    ],
)
def test_the_measurement_check_catches_quoted_figures(line):
    assert MEASUREMENT.search(yaml_comment(line)), line


def test_config_lines_are_short_and_comments_quote_no_measurement():
    """Every line <= 100 characters; a comment describes its key, measurements live in docs/."""
    files = sorted(CONFIGS.rglob("*.yaml"))
    assert len(files) >= 14
    long, measured = [], []
    for f in files:
        for no, line in enumerate(f.read_text().splitlines(), 1):
            where = f"{f.relative_to(ROOT)}:{no}"
            if len(line) > 100:
                long.append(f"{where}: {len(line)} characters")
            if MEASUREMENT.search(yaml_comment(line)):
                measured.append(f"{where}: {line.strip()}")
    assert not long, "lines over 100 characters:\n" + "\n".join(long)
    assert not measured, "comments quoting measurements (move them to docs/):\n" + "\n".join(
        measured
    )


def test_groups_carry_only_their_own_keys():
    """No option repeats another's keys (main had 33 lines commented 'unused')."""
    unused = [
        f"{f.relative_to(ROOT)}: {line.strip()}"
        for f in CONFIGS.rglob("*.yaml")
        for line in f.read_text().splitlines()
        if re.search(r"#.*\bunused\b", line)
    ]
    assert not unused, "\n".join(unused)
    assert set(load(overrides=["backend=trainside"]).backend) == {"max_batch_size"}
    assert "max_batch_size" not in load(overrides=["backend=sglang"]).backend
    assert "path" not in load().data and "num_rows" not in load(overrides=["data=dapo_math"]).data
    assert {"hidden_size", "path"} & set(load(overrides=["model=smollm2_135m"]).model) == set()
    grpo = load(overrides=["algo=grpo"]).algo
    assert grpo.gae == {  # defaults
        "lmbda": 0.95,
        "critic_lmbda": None,
        "normalize_advantage": True,
        "timestep": "token",
    }
    assert "grpo" not in OmegaConf.load(CONFIGS / "algo" / "ppo_gae.yaml")
    assert not {"gae", "clip_value", "value_lr"} & set(
        OmegaConf.load(CONFIGS / "algo" / "grpo.yaml")
    )


@pytest.mark.parametrize(
    ("overrides", "model", "backend", "data"),
    [
        ([], TinyModelConfig, TrainsideBackendConfig, ArithmeticDataConfig),
        (["algo=grpo"], TinyModelConfig, TrainsideBackendConfig, ArithmeticDataConfig),
        (
            ["model=smollm2_135m", "backend=sglang"],
            SmolLM2ModelConfig,
            SGLangBackendConfig,
            ArithmeticDataConfig,
        ),
        (
            ["data=dapo_math", "logger=none"],
            TinyModelConfig,
            TrainsideBackendConfig,
            DapoMathDataConfig,
        ),
    ],
)
def test_cpu_default_and_groups_compose_to_typed_configs(overrides, model, backend, data):
    cfg = typed(overrides)
    assert (type(cfg.model), type(cfg.backend), type(cfg.data)) == (model, backend, data)
    assert cfg.rollout.prompts_per_iter == 16 and cfg.rollout.samples_per_prompt == 4
    assert isinstance(cfg.cache_dir, str) and "${" not in cfg.cache_dir  # interpolations resolved


def test_gpu_recipe_values():
    cfg = typed(name="qwen3_4b_base_dapo_sglang")
    assert isinstance(cfg.model, PretrainedModelConfig) and cfg.model.path.endswith("Qwen3-4B-Base")
    assert isinstance(cfg.backend, SGLangBackendConfig) and isinstance(cfg.data, DapoMathDataConfig)
    assert cfg.data.path.endswith(".parquet")
    r, a = cfg.rollout, cfg.algo
    assert (r.prompts_per_iter, r.samples_per_prompt, r.max_new_tokens) == (64, 8, 8192)
    assert r.overlong_buffer == 4096 and r.token_budget > 0
    assert list(a.clip_epsilon) == [0.2, 0.28] and a.clip_value == 0.2
    assert (a.gamma, a.gae.lmbda, a.lr, a.loss_agg_mode) == (1.0, 0.95, 1e-6, "token_mean")
    assert a.kl_coeff == 0.0 and not hasattr(a.grpo, "drop_zero_spread")  # rollout.dynamic_sampling


def test_gpu_recipe_instantiates_up_to_the_gpu(tmp_path):
    """Everything but the 4B weights and the server: data, advantage (both modes), loss, optimizer."""
    from ar_torchrl.data.datasets import make_row
    from ar_torchrl.models.tiny import build_tiny_qwen3
    from ar_torchrl.modules import LMActorCritic, attach_value_head
    from ar_torchrl.objectives import GRPOAdvantage, RLOOAdvantage, TokenGAE, TokenPPOLoss
    from ar_torchrl.recipes.strategy import LocalStrategy

    recipe = recipe_module()
    data = tmp_path / "dapo.jsonl"
    rows = [make_row(f"What is {i} + 1?", str(i + 1), index=i) for i in range(300)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = typed([f"data.path={data}"], name="qwen3_4b_base_dapo_sglang")
    train_rows, eval_rows = recipe.build_datasets(cfg)
    assert (len(train_rows), len(eval_rows)) == (44, 256)
    assert isinstance(recipe.build_advantage(cfg), TokenGAE)
    grpo_cfg = typed(["algo.advantage_mode=grpo"], "qwen3_4b_base_dapo_sglang")
    adv = recipe.build_advantage(grpo_cfg)
    assert isinstance(adv, GRPOAdvantage) and adv.critic_targets
    rloo = recipe.build_advantage(typed(["algo.advantage_mode=rloo"], "qwen3_4b_base_dapo_sglang"))
    assert type(rloo) is RLOOAdvantage and rloo.critic_targets  # the value head keeps training
    assert not recipe.build_advantage(typed(["algo=rloo"])).critic_targets  # algo=rloo: no critic
    model = attach_value_head(build_tiny_qwen3(99))  # stands in for Qwen3-4B-Base
    a = cfg.algo
    loss = TokenPPOLoss(
        LMActorCritic(model),
        clip_epsilon=tuple(a.clip_epsilon),
        clip_value=a.clip_value,
        critic_coeff=a.critic_coeff,
        kl_coeff=a.kl_coeff,
        loss_agg_mode=a.loss_agg_mode,
    )
    assert (loss.clip_epsilon_low.item(), loss.clip_epsilon_high.item()) == pytest.approx(
        (0.2, 0.28)
    )
    opt = recipe.build_optimizer(cfg, model)
    assert [g["lr"] for g in opt.param_groups] == [1e-6, 1e-5]
    with pytest.raises(FileNotFoundError, match="is not a HF model directory"):
        cfg = typed(["model.path=/nonexistent/Qwen3-4B"], "qwen3_4b_base_dapo_sglang")
        LocalStrategy().build_policy(cfg.model, cfg.cache_dir)


#: Each was accepted on main and silently trained wrong, froze, deleted checkpoints or failed late.
RANGE_ERRORS = [
    (["algo.grad_clip=-1"], r"config: algo.grad_clip must be > 0, got -1.0 \(None disables"),
    (["algo.grad_clip=0"], r"config: algo.grad_clip must be > 0, got 0.0"),
    (["algo.lr=-1e-3"], r"config: algo.lr must be > 0, got -0.001"),
    (["train.keep_checkpoints=-1"], r"config: train.keep_checkpoints must be >= 1, got -1"),
    (["train.checkpoint_every=-1"], r"config: train.checkpoint_every must be >= 0, got -1"),
    (["train.eval_every=-3"], r"config: train.eval_every must be >= 0, got -3"),
    (["algo.advantage_mode=vtrace"], r"algo.advantage_mode='vtrace' is not one of \['gae', 'grpo'"),
    (["train.mode=threads"], r"train.mode='threads' is not one of \['sync', 'async'\]"),
    (["rollout.max_new_tokens=0"], r"rollout.max_new_tokens must be >= 1, got 0"),
    (
        ["algo.clip_epsilon=[0.2]"],
        r"algo.clip_epsilon must be a float in \(0, 1\) or \(low, high\)",
    ),
    (["algo.clip_epsilon=[0.2,0]"], r"algo.clip_epsilon must be"),  # the library's own range
    (
        ["algo.critic_coeff=0"],
        r"advantage_mode=gae needs the value head: set algo.critic_coeff > 0",
    ),
    (["algo.gae.lmbda=1.5"], r"algo.gae.lmbda must be >= 0 and <= 1, got 1.5"),
    # issue 16: each ended in a raw numpy / torch / torchrl traceback after the stack was loaded
    (["seed=4294967296"], r"config: seed must be <= 4294967295, got 4294967296"),
    (["num_threads=1000000000000"], r"config: num_threads must be <= 1024"),
    (["rollout.max_new_tokens=1000000000000"], r"rollout.max_new_tokens must be <= 1048576"),
    (["rollout.prompts_per_iter=1000000000000"], r"rows per batch, more than 1048576"),
    (["data.num_rows=1000000000000"], r"data.num_rows must be >= 1 and <= 1000000"),
    (["runs_dir=''"], r"config: runs_dir must name a directory, got ''"),
    (["backend=sglang", "backend.url=[]"], r"backend.url must be null, a URL or a non-empty list"),
    (["backend=sglang", "backend.url=abc"], r"backend.url='abc' is not a server URL"),
    (  # one dynamic-sampling key: rollout.dynamic_sampling (the GRPO-only spelling is gone)
        ["algo=grpo", "+algo.grpo.drop_zero_spread=true"],
        r"no schema has the key\(s\) algo.grpo.drop_zero_spread",
    ),
    (["rollout.top_p=0"], r"rollout.top_p must be > 0 and <= 1, got 0.0"),
    (["rollout.top_k=0"], r"rollout.top_k must be -1 \(off\) or >= 1, got 0"),
    (["rollout.overlong_buffer=20"], r"rollout.overlong_buffer must be >= 1 and <= 12, got 20"),
    (["train.eval_prompts=65"], r"train.eval_prompts=65 must be <= data.holdout=64"),
    (["model.hidden_size=66"], r"model.hidden_size=66 must be a multiple of model.num_heads=4"),
    (["device=gpu"], r"device='gpu' must be cpu, cuda or cuda:<index>"),
    (
        ["rollout.packing=sometimes"],
        r"config: rollout.packing='sometimes' must be false, true or auto",
    ),
    (  # an interpolation to a number: the check names the key (was a bare TypeError)
        ["algo.clip_epsilon=${seed}"],
        r"config: algo.clip_epsilon must be a float in \(0, 1\) or \(low, high\) .*got 0",
    ),
    (
        ["rollout.shared_prefix=sometimes"],
        r"config: rollout.shared_prefix='sometimes' must be false, true or auto",
    ),
    (
        [
            "rollout.shared_prefix=true",
            "rollout.packing=false",
            "model.gradient_checkpointing=true",
        ],
        r"config: rollout.shared_prefix=true with rollout.packing=false \(padded shared "
        r"micro-batches\) cannot run with model.gradient_checkpointing=true",
    ),
    (
        ["rollout.shared_prefix=true", "rollout.packing=false", "model.dtype=bfloat16"],
        r"config: rollout.shared_prefix=true with rollout.packing=false .* cannot run with FSDP2 "
        r".*set rollout.packing=auto or true \(packed shared micro-batches, one backbone call\)",
    ),
    (["algo.loss_agg_mode=mean"], r"algo.loss_agg_mode='mean' is not one of \['token_mean'"),
    (["data=dapo_math", "data.path=${oc.env:NO_SUCH_VAR_AR}"], r"NO_SUCH_VAR_AR"),
    # ranges that come from the library's own per-entry-point checks (ar_torchrl.utils.checks)
    (
        ["algo.clip_value=-0.2"],
        r"config: algo.clip_value must be > 0, got -0.2 \(None disables value clipping\)",
    ),
    (["algo.value_lr=-1e-3"], r"config: algo.value_lr must be >= 0, got -0.001"),
    (
        ["algo.grpo.scale=true", "algo.num_minibatches=0"],
        r"config: algo.num_minibatches must be >= 1",
    ),
    (["model.warm_start.lr=0"], r"config: model.warm_start.lr must be > 0, got 0.0"),
    (
        ["backend=sglang", "+backend.weight_sync_options.master_port=3"],
        r"config: backend.weight_sync_options.master_port: weight sync method 'disk' has no "
        r"option 'master_port'; its options: \['config_dir', 'tmp_root', 'bucket_bytes'\]",
    ),
    # the dist group and the precision keys (FSDP2 under torchrun, bf16 compute over fp32 masters)
    (["dist.backend=mpi"], r"config: dist.backend='mpi' is not one of \['auto', 'gloo', 'nccl'\]"),
    (["dist.fsdp=maybe"], r"config: dist.fsdp='maybe' must be auto, true or false"),
    (["dist.timeout_s=0"], r"config: dist.timeout_s must be > 0, got 0.0"),
    (["dist.backend=nccl"], r"config: dist.backend=nccl needs device=cuda, got device=cpu"),
    (["model.dtype=fp8"], r"config: model.dtype='fp8' is not one of \['float32', 'bfloat16'"),
    (
        ["model.dtype=bfloat16", "dist.fsdp=false"],
        r"dist.fsdp=false but model.dtype=bfloat16 needs FSDP2 .* set dist.fsdp=auto",
    ),
    (
        ["model.dtype=bfloat16", "device=cuda:1"],
        r"device=cuda:1: with FSDP2 each rank uses cuda:LOCAL_RANK; set device=cuda",
    ),
    (  # the update then failed on every iteration with a KeyError (no loss_critic)
        ["algo=grpo", "algo.critic_warmup_iters=2"],
        r"algo.critic_warmup_iters=2 trains only the value head, which algo.critic_coeff=0.0",
    ),
    (
        ["model.warm_start.correct_fraction=1.5"],
        r"config: model.warm_start.correct_fraction must be >= 0 and <= 1",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), RANGE_ERRORS)
def test_bad_values_are_rejected_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        typed(overrides)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.iterations=true", r"Value 'True' of type 'bool' could not be converted to Integer"),
        ("rollout.temperature=abc", r"Value 'abc' of type 'str' could not be converted to Float"),
        ("train.iterations=1.5", r"Value '1.5' of type 'float' could not be converted to Integer"),
        ("rollout.max_new_token=3", r"Key 'max_new_token' not in 'RolloutConfig'"),
        ("model.path=x", r"Key 'path' not in 'TinyModelConfig'"),  # keys of another option
        ("algo.lmbda=0.9", r"Key 'lmbda' not in 'AlgoConfig'"),  # GAE's keys live in algo.gae
    ],
)
def test_wrong_types_and_unknown_keys_fail_while_composing(override, message):
    key = override.split("=")[0]
    with pytest.raises(ConfigCompositionException) as info:
        load(overrides=[override])
    cause = str(info.value.__cause__)
    assert re.search(message, cause), cause
    assert f"full_key: {key}" in cause


def test_config_check_never_imports_torch():
    code = (
        "import sys\n"
        "from support.recipe_helpers import typed\n"
        "cfg = typed(['backend=sglang', 'algo=rloo', 'data=fewshot_arithmetic'])\n"
        "print(type(cfg).__name__, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT / "tests",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["Config", "False"]


def test_resumable_changes_exist_in_the_schema():
    from ar_torchrl.recipes import dapo_ppo

    cfg = OmegaConf.structured(recipe_config.Config)
    for key in dapo_ppo.RESUMABLE_CHANGES:
        section, leaf = key.split(".")
        assert leaf in cfg[section].keys(), key


def test_dist_group_and_when_the_recipe_shards(monkeypatch):
    """FSDP2 when torchrun starts several processes or the compute dtype is not float32; the CPU
    default stays one plain process (same code path, same numbers)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = typed()
    assert cfg.dist == recipe_config.DistConfig(
        backend="auto", fsdp="auto", reshard_after_forward=True, timeout_s=1800.0
    )
    assert (cfg.model.dtype, cfg.model.gradient_checkpointing, cfg.sharded) == (
        "float32",
        False,
        False,
    )
    assert typed(["model.dtype=bfloat16"]).sharded and typed(["dist.fsdp=true"]).sharded
    gpu = typed(name="qwen3_4b_base_dapo_sglang")
    assert (gpu.dist.backend, gpu.model.dtype, gpu.model.gradient_checkpointing) == (
        "nccl",
        "bfloat16",
        True,
    )
    assert gpu.sharded and gpu.device == "cuda" and gpu.dist.timeout_s >= 1800
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun --nproc-per-node 2
    assert typed().sharded
    with pytest.raises(ValueError, match="dist.fsdp=false but WORLD_SIZE=2 needs FSDP2"):
        typed(["dist.fsdp=false"])


def test_weight_sync_options_are_the_senders_options():
    """``backend.weight_sync_options`` reach the sender (e.g. the address remote servers reach rank
    0 at, for ``distributed`` across machines); the schema's table is each sender's signature."""
    import inspect

    from ar_torchrl.backends import SGLangBackend
    from ar_torchrl.backends.sglang import senders
    from ar_torchrl.weight_sync.registry import SYNC_METHODS

    classes = {
        "disk": senders.DiskWeightSender,
        "tensor": senders.TensorWeightSender,
        "distributed": senders.DistributedWeightSender,
    }
    for method, cls in classes.items():  # the registered schema = the sender's keyword arguments
        params = inspect.signature(cls).parameters.values()
        options = [f.name for f in dataclasses.fields(SYNC_METHODS[method].config)]
        assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == options, method
    b = typed(
        [
            "backend=sglang",
            "backend.weight_sync=distributed",
            "+backend.weight_sync_options.master_address=10.0.0.7",
        ]
    ).backend
    backend = SGLangBackend(
        ["http://127.0.0.1:9"],
        weight_sync=b.weight_sync,
        weight_sync_options=dict(b.weight_sync_options),
    )
    try:
        assert backend.sender.master_address == "10.0.0.7"
    finally:
        backend.close()


def test_a_run_saved_before_the_added_keys_still_matches_for_auto_resume(tmp_path):
    """``imports``, ``rollout.env`` and ``rollout.env_options`` are new: a run directory whose
    saved config predates them is the same configuration when it has their defaults."""
    from ar_torchrl.recipes.dapo_ppo import main

    raw = load()
    saved = OmegaConf.to_container(raw, resolve=False)
    del saved["imports"], saved["rollout"]["env"], saved["rollout"]["env_options"]
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    assert main._matches(raw)(path)
    saved["rollout"]["env"] = "tool"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    assert not main._matches(raw)(path)
