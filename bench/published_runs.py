"""Read the published-runs calibration file (``shared/reference/published-runs-calibration.csv``).

One row is one run another group published: model shape, GPU kind and count, layout, batch,
recompute, precision and one measured number (``published-runs.md`` beside the file). Each row
becomes a `PublishedRun` (an `autopar.calibrate.runs.Run` that also knows its source, GPU kind,
model shape and which of its settings the source did not state), or is kept with a reason it
cannot be priced (`PublishedRun.skip`), or, when the row is malformed, a `RunsError` names the
row, the column and the fix.

How a row becomes a model and a layout (one rule for every row, none per model or source):

- shape: ``ffn_hidden == 4 * hidden`` with as many kv heads as heads is a GPT-style block
  (fused qkv, LayerNorm, GELU MLP, learned positions, tied embeddings: the zoo's "gpt2"
  family); anything else a Llama-style block (RMSNorm, SwiGLU of ``ffn_hidden``, GQA, untied).
  A head width other than hidden / heads comes from a ``head_dim`` column or the notes'
  "head_dim N";
- a mixture of experts (``ffn_hidden`` "F per expert (E experts, top-K)", or ``ep > 1``) is
  not priced: the zoo's MoE (static capacity buffers, each expert's GEMM on one rank's
  tokens) is not how the recipes run theirs (permuted tokens, grouped GEMMs over the ep
  group's tokens, per-recipe recompute not stated). Priced so, the file's seven expressible
  MoE runs landed at 0.5-1.6x their throughput and 1.7-5x the memory they trained in;
- measured throughput in tokens/s/GPU: as published; from ``hardware_tflops_per_gpu`` through
  the source's own FLOP count (Narayanan et al. eq. 3, which includes the recompute forward:
  tok/s/GPU = X / (96 l h^2 (1 + s/6h + V/16lh))); from ``step_time_s`` as
  global batch * seq / step / GPUs;
- ZeRO: FSDP FULL_SHARD and "3" are ZeRO-3, SHARD_GRAD_OP ZeRO-2, "1 (...)" ZeRO-1, "0" none;
- precision: fp8, "fp8 (...)" and mxfp8 price every weight matmul in FP8, the rest bf16;
- framework: a source or note naming NeMo, Megatron-Bridge or Megatron-Core is NVIDIA's
  performance recipes on Megatron-Core (`MEGATRON_CORE`), whose `CommOverlapConfig` overlaps
  TP communication with GEMMs under SP (Transformer Engine's userbuffers), the interleaved
  schedule's transfers and the distributed optimizer's weight gather with compute; the
  pricer prices those overlaps (`bench.published.PublishedPricer.framework_facts`). Any other source:
  the overlaps autopar's runtime has;
- not stated (empty): micro-batch 1, ZeRO-1 (Megatron's distributed optimizer, the recipes'
  default), no recompute, SP where tp > 1, a pipeline's interleave depth 1; such a run is
  marked (`PublishedRun.assumed`) and scored apart from the runs stated in full. A run whose
  degrees, vocabulary or model-parallel split are not stated is skipped.
"""

from __future__ import annotations

import csv
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from autopar.calibrate.runs import Run, RunsError
from autopar.models.configs import ModelConfig
from vocab.layout import Layout, LayoutError

COLUMNS = ("source", "model_name", "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab",
           "seq_len", "gpu", "num_gpus", "gpus_per_node", "dp", "tp", "pp", "virtual_pp", "cp",
           "ep", "zero_or_fsdp", "sp", "microbatch", "global_batch_sequences", "recompute",
           "precision", "measured_metric", "measured_value")
METRICS = ("tokens_per_s_per_gpu", "hardware_tflops_per_gpu", "step_time_s")
# the framework of NVIDIA's performance recipes, named by their source or notes
MEGATRON_CORE = "megatron-core"
_MEGATRON_CORE_WORDS = re.compile(r"\bNeMo\b|Megatron-Bridge|Megatron-Core|\bmcore\b", re.IGNORECASE)
# the GPU column's words -> the shipped cluster profile of that kind (cost.cluster.PROFILES)
GPU_PROFILES = (("a100-40gb", "a100-40gb"), ("a100-80gb", "a100-80gb"), ("h100", "h100"),
                ("h200", "h200"), ("b200", "b200"))


@dataclass(frozen=True)
class PublishedRun(Run):
    """A `Run` of the published file. ``model`` is a key of the run's model shape (`config`);
    ``name`` the source's model name; ``profile`` the cluster profile of its GPU kind;
    ``assumed``: the settings the source did not state and the reader assumed; ``framework``:
    `MEGATRON_CORE` or "" (see the module docstring)."""

    source: str = ""
    name: str = ""
    profile: str = ""
    config: ModelConfig | None = None
    assumed: tuple[str, ...] = field(default=())
    metric: str = ""
    framework: str = ""

    @property
    def cell(self) -> tuple[str, str, str]:
        """(source, model, GPU kind): the runs ranked together (`group`)."""
        return (self.source, self.name, self.profile)


def short_source(text: str) -> str:
    """A source's short name: its first words before a parenthesis, comma or year."""
    words = re.split(r"[(,]| 20\d\d", text, maxsplit=1)[0].split()
    return " ".join(words[:3] if words[1:2] == ["et"] else words[:2]) or text[:30]


def read_published(path: str | os.PathLike) -> list[PublishedRun]:
    """Every row of the file as a `PublishedRun` (skipped ones with their reason);
    `RunsError` naming the first malformed row, its column and the fix."""
    source = Path(path)
    if not source.exists():
        raise RunsError(f"no published-runs file at {source}; pass the CSV described in "
                        "shared/reference/published-runs.md")
    with source.open(newline="") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise RunsError(f"{source}: the header lacks {', '.join(missing)}; the published-runs "
                            f"reader needs {', '.join(COLUMNS)}")
        runs = [parse_row(f"{source}, row {i}", i, {k.strip(): (v or "").strip()
                                                   for k, v in row.items() if k})
                for i, row in enumerate(reader, start=2)]
    if not runs:
        raise RunsError(f"{source} holds no runs; add one row per published run")
    return runs


def _int(where: str, row: dict, col: str, default: int | None = None) -> int | None:
    text = row[col]
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise RunsError(f"{where}: {col}={text!r} is not a number; write a whole number or leave "
                        "it empty where the source does not state it") from None
    if value != int(value) or value < 0:
        raise RunsError(f"{where}: {col}={text!r} must be a whole number >= 0")
    return int(value)


def _profile(where: str, gpu: str) -> str:
    key = gpu.lower().replace(" ", "")
    for word, profile in GPU_PROFILES:
        if word in key:
            return profile
    raise RunsError(f"{where}: gpu={gpu!r} names no GPU kind with a shipped profile; write one "
                    f"of {', '.join(w.upper() for w, _ in GPU_PROFILES)} in the gpu column")


def _zero(where: str, text: str) -> tuple[int, bool]:
    """(ZeRO stage, assumed)."""
    low = text.lower()
    if not low:
        return 1, True
    if low[0] in "0123":  # a stated stage first: "1 (...; table FSDP=0)" is ZeRO-1
        return int(low[0]), False
    if "shard_grad_op" in low:
        return 2, False
    if "fsdp" in low:
        return 3, False
    raise RunsError(f"{where}: zero_or_fsdp={text!r} is not understood; write 0, 1, 2, 3, "
                    "'fsdp (FULL_SHARD)' or 'fsdp (SHARD_GRAD_OP)'")


def _measured(where: str, row: dict, seq: int, gpus: int, gbs: int, cfg: ModelConfig) -> float:
    metric = row["measured_metric"]
    if metric not in METRICS:
        raise RunsError(f"{where}: measured_metric={metric!r} is unknown; use one of {METRICS}")
    try:
        value = float(row["measured_value"])
    except ValueError:
        raise RunsError(f"{where}: measured_value={row['measured_value']!r} is not a number"
                        ) from None
    if not math.isfinite(value) or value <= 0:
        raise RunsError(f"{where}: measured_value={value:g} must be > 0")
    if metric == "tokens_per_s_per_gpu":
        return value
    if metric == "step_time_s":
        return gbs * seq / value / gpus
    h, L, V = cfg.hidden, cfg.n_layers, cfg.vocab
    return value * 1e12 / (96 * L * h * h * (1 + seq / (6 * h) + V / (16 * L * h)))


# "768 per expert (128 experts, top-8)": a mixture of experts' ffn_hidden
_EXPERTS = re.compile(r"(\d+)\s*per expert\s*\((\d+)\s*experts?,\s*top-?(\d+)\)", re.IGNORECASE)
_HEAD_DIM_NOTE = re.compile(r"\bhead[_ ]dim\s*=?\s*(\d+)", re.IGNORECASE)


def _ffn(where: str, row: dict) -> tuple[int | None, tuple[int, int] | None]:
    """(ffn width, (experts, top-k) of a mixture of experts or None); width None where the
    column is not a number or the experts' form."""
    text = row["ffn_hidden"]
    m = _EXPERTS.fullmatch(text)
    if m:
        return int(m.group(1)), (int(m.group(2)), int(m.group(3)))
    if text.isdigit() or not text:
        return _int(where, row, "ffn_hidden"), None
    return None, None


def _head_dim(where: str, row: dict) -> int | None:
    """The ``head_dim`` column, else the notes' "head_dim N", else None (hidden / heads)."""
    if row.get("head_dim"):
        return _int(where, row, "head_dim")
    m = _HEAD_DIM_NOTE.search(row.get("notes", ""))
    return int(m.group(1)) if m else None


def _config(where: str, key: str, ints: dict, experts: tuple[int, int] | None,
            head_dim: int | None) -> ModelConfig | str:
    """The zoo config of the row's shape, or the reason it cannot be priced; `RunsError`
    naming the row where the shape itself is malformed."""
    h, heads, kv, ffn = ints["hidden"], ints["heads"], ints["kv_heads"], ints["ffn_hidden"]
    if experts is not None or ints["ep"] > 1 or ffn is None:
        what = f" ({experts[0]} experts, top-{experts[1]})" if experts else ""
        return (f"a mixture of experts{what}: not priced by this bench (the zoo's MoE is not "
                "the recipes': bench/published_runs.py)")
    if ints["vocab"] is None:
        return "vocabulary not stated: the logits' size is unknown"
    gpt = ffn == 4 * h  # the GPT-style block: MHA of hidden / heads
    if gpt and (kv != heads or head_dim not in (None, h // heads)):
        return ("a non-gated 4h MLP with grouped-query attention or a head width other than "
                "hidden / heads: no zoo block has that combination")
    common = dict(n_layers=ints["layers"], hidden=h, n_heads=heads, n_kv_heads=kv, ffn=ffn,
                  vocab=ints["vocab"], max_seq=ints["seq_len"])
    try:
        if gpt:
            return ModelConfig(key, family="gpt2", norm="layernorm", tied=True, **common)
        return ModelConfig(key, family="llama", norm="rmsnorm", tied=False, rope_theta=500000.0,
                           head_dim=head_dim, **common)
    except ValueError as e:
        raise RunsError(f"{where}: the model shape is inconsistent ({e}); fix the row's "
                        "hidden, heads, kv_heads or head_dim") from None


def parse_row(where: str, line: int, row: dict) -> PublishedRun:
    """One row (see the module docstring)."""
    ints: dict[str, int | None] = {}
    variant = ""  # an attention the zoo has no block for ("128 (MLA)")
    for col in ("heads", "kv_heads"):
        m = re.fullmatch(r"(\d+)\s*\((.+)\)", row[col])
        if m:
            variant = f"{col}={row[col]!r}: {m.group(2)} attention is not priced by this bench"
            row = {**row, col: m.group(1)}
        elif not row[col] and variant:
            row = {**row, col: row["heads"]}
    for col in ("layers", "hidden", "heads", "kv_heads", "seq_len", "num_gpus", "gpus_per_node",
                "global_batch_sequences"):
        ints[col] = _int(where, row, col)
        if not ints[col]:
            raise RunsError(f"{where}: {col} is empty or 0; every run needs its {col}")
    ints["ffn_hidden"], experts = _ffn(where, row)
    head_dim = _head_dim(where, row)
    ints["vocab"] = _int(where, row, "vocab")
    for col in ("dp", "tp", "pp", "cp", "ep"):
        ints[col] = _int(where, row, col, default=None if col in ("dp", "tp", "pp") else 1)
    assumed: list[str] = []
    vpp = row["virtual_pp"]
    virtual = int(vpp) if vpp.isdigit() else 1
    if vpp and not vpp.isdigit():
        assumed.append("interleave depth")
    profile = _profile(where, row["gpu"])
    zero, zero_assumed = _zero(where, row["zero_or_fsdp"])
    if zero_assumed:
        assumed.append("zero")
    mb = _int(where, row, "microbatch")
    if mb is None:
        mb = 1
        assumed.append("microbatch")
    rec = row["recompute"].lower()
    if not rec:
        assumed.append("recompute")
    if rec and not rec.startswith(("none", "full")):
        raise RunsError(f"{where}: recompute={row['recompute']!r}; write none or full")
    sp_text = row["sp"]
    if not sp_text:
        assumed.append("sp")
    prec = row["precision"].lower()
    fp8 = "fp8" in prec
    name, seq, gpus, gbs = row["model_name"], ints["seq_len"], ints["num_gpus"], \
        ints["global_batch_sequences"]
    key = (f"{name} L{ints['layers']} h{ints['hidden']} f{ints['ffn_hidden']} "
           f"a{ints['heads']}/{ints['kv_heads']} v{ints['vocab']}"
           + (f" d{head_dim}" if head_dim else "")
           + (f" e{experts[0]}k{experts[1]}" if experts else ""))
    cfg = variant or _config(where, key, ints, experts, head_dim)
    skip = cfg if isinstance(cfg, str) else ""
    per_node = ints["gpus_per_node"]
    dp, tp, pp, cp = (ints[c] for c in ("dp", "tp", "pp", "cp"))
    if not skip and None in (dp, tp, pp):
        skip = "degrees (dp, tp, pp) not all stated: the model-parallel split is unknown"
    if not skip and dp * tp * pp * cp != gpus:
        skip = f"dp*tp*pp*cp = {dp * tp * pp * cp} but num_gpus = {gpus}"
    if not skip and (gpus % per_node or gbs % (dp * mb)):
        skip = (f"{gpus} GPUs in nodes of {per_node}, or a global batch of {gbs} sequences not "
                f"a multiple of dp*microbatch = {dp * mb}")
    measured = _measured(where, row, seq, gpus, gbs, cfg) if not isinstance(cfg, str) else None
    layout = Layout(dp=dp or 1, tp=tp or 1, pp=pp or 1)
    if not skip:
        try:
            layout = Layout(
                dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, sp=bool(int(sp_text)) if sp_text else tp > 1,
                microbatch=mb, grad_accum=gbs // (dp * mb),
                schedule="interleaved-1f1b" if virtual > 1 else "1f1b", virtual_stages=virtual,
                recompute="full" if rec.startswith("full") else "none", precision="bf16",
                fp8="all" if fp8 else "none", fp32_grad_accum=True)
        except LayoutError as e:
            skip = f"the layout cannot be expressed: {e}"
    return PublishedRun(row=line, model=key, nodes=max(1, gpus // per_node), layout=layout,
                        seq=seq, tok_s_gpu=measured, gpu_mem_gb=None, skip=skip,
                        source=short_source(row["source"]), name=name, profile=profile,
                        config=None if isinstance(cfg, str) else cfg, assumed=tuple(assumed),
                        metric=row["measured_metric"],
                        framework=MEGATRON_CORE if _MEGATRON_CORE_WORDS.search(
                            f"{row['source']} {row.get('notes', '')}") else "")
