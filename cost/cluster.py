"""Clusters: a GPU kind, how many nodes of how many GPUs, and the links between them.

Named profiles carry datasheet link rates plus the achieved fractions that published
measurements show; ``"h100-efa"`` additionally carries the bus-bandwidth curves measured on the
Ultra-Scale Playbook's cluster, which `cost.comm` uses as calibration points.
`Cluster.local()` describes this machine from the file `autopar calibrate` writes.
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .calibration import (
    COLLECTIVES,
    Calibration,
    CollectiveFit,
    default_calibration_path,
    load_calibration,
)
from .hardware import DTYPES, GPUS, GPUSpec, get_gpu
from .params import CostParams
from .profile import load_profile
from .rings import ring_steps

PROFILE_DIR = Path(__file__).parent / "profiles"
# The fit of the cost model's free parameters to the playbook's 1B/8B runs (`autopar calibrate
# --runs shared/reference/playbook-runs-1b-8b.csv --cluster h100-efa`): what "h100-efa" prices with.
H100_EFA_FIT = PROFILE_DIR / "h100_efa_fit.json"


@dataclass(frozen=True)
class Link:
    """One kind of link as seen by one GPU.

    bandwidth: payload bytes per second per GPU, one direction.
    latency: seconds per message step (one hop of a ring).
    """

    bandwidth: float
    latency: float
    source: str


@dataclass(frozen=True)
class HostShare:
    """Ranks that time-share one host's cores (local CPU ranks): ``cores`` as os.cpu_count()
    reports them, ``threads`` the calibration's thread count, ``threads_per_rank`` each rank's
    (`rank_share`). A rank idle in a pipeline bubble lends its core to the busy ones."""

    cores: int
    threads: int
    threads_per_rank: int
    # seconds a pipeline hand-off waits per second of the stages' compute between hand-offs:
    # the receiving peer descheduled by ranks that compute (`autopar calibrate`, two stage weights)
    wait_per_compute: float = 0.0

    def busy_speedup(self, ranks: int, busy: float) -> float:
        """How much faster a rank computes when only a ``busy`` fraction of the ``ranks`` runs
        at once than when all do (1.0: no gain; `rank_share` at ranks * busy active ranks)."""
        def share(active: float) -> float:
            return rank_share(self.threads, self.cores, max(active, 1e-9), self.threads_per_rank)[0]
        return share(ranks * busy) / share(ranks)


# --- link datasheets and published measurements -----------------------------------------------
_NCCL_TUNING = "NCCL src/graph/tuning.cc (v2.19 tables)"
# NCCL's per-hop latency of the ring LL protocol, the one it picks for latency-bound messages:
# NVLink 0.6 us, network 2.7 us; base latency of a ring collective 6.6 us.
NVLINK_HOP_LATENCY_S = 0.6e-6
IB_HOP_LATENCY_S = 2.7e-6
NCCL_BASE_LATENCY_S = 6.6e-6
# aws-ofi-nccl's tuner models EFA with a 20 us network latency (include/nccl_ofi_tuner.h,
# NET_LATENCY).
EFA_HOP_LATENCY_S = 20e-6

NVLINK4 = Link(
    bandwidth=450e9,
    latency=NVLINK_HOP_LATENCY_S,
    source=(
        "NVLink4: 900 GB/s bidirectional per GPU = 450 GB/s per direction (NVIDIA H100 "
        f"datasheet); hop latency: {_NCCL_TUNING} hwLat NVLink ring LL"
    ),
)
NDR_IB_PER_GPU = Link(
    bandwidth=50e9,
    latency=IB_HOP_LATENCY_S,
    source=(
        "8x ConnectX-7 400 Gb/s NDR InfiniBand per DGX H100 node (DGX H100 datasheet) = "
        f"50 GB/s per GPU; hop latency: {_NCCL_TUNING} hwLat NET ring LL"
    ),
)
EFA_P5_PER_GPU = Link(
    bandwidth=50e9,
    latency=EFA_HOP_LATENCY_S,
    source=(
        "AWS p5.48xlarge: 3200 Gbps EFA per node (AWS instance specification) = 400 GB/s / 8 "
        "= 50 GB/s per GPU; latency: aws-ofi-nccl tuner NET_LATENCY 20 us"
    ),
)
NVLINK3 = Link(
    bandwidth=300e9,
    latency=NVLINK_HOP_LATENCY_S,
    source=(
        "NVLink3: 600 GB/s bidirectional per GPU = 300 GB/s per direction (NVIDIA A100 "
        f"datasheet); hop latency: {_NCCL_TUNING} hwLat NVLink ring LL"
    ),
)
NVLINK5 = Link(
    bandwidth=900e9,
    latency=NVLINK_HOP_LATENCY_S,
    source=(
        "NVLink5: 1.8 TB/s bidirectional per GPU = 900 GB/s per direction (NVIDIA HGX B200 "
        f"datasheet); hop latency assumed NVLink4's: {_NCCL_TUNING} hwLat NVLink ring LL"
    ),
)
HDR_IB_PER_GPU = Link(
    bandwidth=25e9,
    latency=IB_HOP_LATENCY_S,
    source=(
        "8x ConnectX-6 200 Gb/s HDR InfiniBand compute ports per DGX A100 node (DGX A100 "
        f"datasheet) = 25 GB/s per GPU; hop latency: {_NCCL_TUNING} hwLat NET ring LL"
    ),
)
CPU_LOOPBACK = Link(
    bandwidth=1e9,
    latency=50e-6,
    source="placeholder for gloo over shared memory/loopback until `autopar calibrate` runs",
)
CPU_ETHERNET = Link(
    bandwidth=1.25e9,
    latency=50e-6,
    source="placeholder: 10 GbE per node, until measured",
)

# Achieved bus bandwidth inside one H100 node as a fraction of the NVLink4 link rate, from the
# playbook table at 1 node: all-reduce 436 GB/s (NCCL reduces in the NVSwitch with NVLS, so it
# beats the copy-only collectives), all-gather and reduce-scatter 250 GB/s.
# all_to_all and send_recv are made of the same point-to-point copies as the all-gather ring,
# so they are assumed to reach the all-gather fraction.
_H100_AG_FRACTION = 250e9 / 450e9
H100_INTRA_EFFICIENCY = {
    "all_reduce": 436e9 / 450e9,
    "all_gather": _H100_AG_FRACTION,
    "reduce_scatter": 250e9 / 450e9,
    "all_to_all": _H100_AG_FRACTION,
    "send_recv": _H100_AG_FRACTION,
}
# A100 (no NVLS): 8xA100 SXM4 all-reduce busbw 230-250 GB/s of 300 ("NCCL-tests in practice",
# docs.alayanew.com tech blog, reference table); 240/300 assumed for every kind.
A100_INTRA_EFFICIENCY = dict.fromkeys(COLLECTIVES, 240e9 / 300e9)
# B200: no published 8-GPU nccl-tests figure at hand; NVLink5 behind NVSwitch with NVLS like
# the H100's, so the H100's fractions of the link rate are assumed.
B200_INTRA_EFFICIENCY = dict(H100_INTRA_EFFICIENCY)
# NDR 400 Gb/s: "you should see 46-48 GB/s per NIC" (NCCL maintainer, NVIDIA/nccl-tests issue
# #290) -> 47 / 50. Assumed the same for HDR.
IB_EFFICIENCY = 47e9 / 50e9
# EFA: the playbook's 2-node all-reduce, 362 GB/s against 8 NICs x 50 GB/s, is the best the
# network reached in that table -> 0.905. Only used where no measured curve applies.
EFA_EFFICIENCY = 362e9 / 400e9


def _load_curves(filename: str) -> tuple[dict[str, list[tuple[float, float]]], float, int, str]:
    """Read a bus-bandwidth calibration file: (curves in B/s, message bytes, gpus/node, source)."""
    doc = json.loads((PROFILE_DIR / filename).read_text())
    scale = 1e9  # the file stores GB/s
    curves = {
        kind: [(float(n), v * scale) for n, v in zip(doc["nodes"], values)]
        for kind, values in doc["busbw"].items()
    }
    return curves, float(doc["message_bytes"]), int(doc["gpus_per_node"]), doc["source"]


def _fitted(path: Path) -> dict:
    """The params and coverage of a shipped fit (defaults while it is absent)."""
    if not path.exists():
        return {"params": CostParams(), "fit_coverage": None}
    profile = load_profile(path)
    return {"params": profile.params, "fit_coverage": profile.fit.get("coverage")}


def _profile(name: str) -> dict:
    """Field values of the named profile (excluding nodes / gpus_per_node)."""
    if name in ("h100", "h200"):
        return {
            "gpu": GPUS[name],
            "intra": NVLINK4,
            "inter": NDR_IB_PER_GPU,
            "intra_efficiency": dict(H100_INTRA_EFFICIENCY),
            "inter_efficiency": IB_EFFICIENCY,
            "base_latency": NCCL_BASE_LATENCY_S,
            "source": f"{GPUS[name].name} nodes, NVLink4/NVSwitch, NDR InfiniBand (datasheets)",
        }
    if name == "h100-efa":
        curves, message_bytes, gpn, source = _load_curves("h100_efa_busbw.json")
        return {
            "gpu": GPUS["h100"],
            "intra": NVLINK4,
            "inter": EFA_P5_PER_GPU,
            "intra_efficiency": dict(H100_INTRA_EFFICIENCY),
            "inter_efficiency": EFA_EFFICIENCY,
            "base_latency": NCCL_BASE_LATENCY_S,
            "busbw_curves": curves,
            "curve_message_bytes": message_bytes,
            "curve_gpus_per_node": gpn,
            **_fitted(H100_EFA_FIT),
            "source": ("the Ultra-Scale Playbook's cluster; busbw calibration: " + source
                       + f"; cost parameters fitted to its measured runs ({H100_EFA_FIT.name})"),
        }
    if name in ("a100-80gb", "a100-40gb"):
        return {
            "gpu": GPUS[name],
            "intra": NVLINK3,
            "inter": HDR_IB_PER_GPU,
            "intra_efficiency": dict(A100_INTRA_EFFICIENCY),
            "inter_efficiency": IB_EFFICIENCY,
            "base_latency": NCCL_BASE_LATENCY_S,
            "source": f"DGX A100 nodes of {GPUS[name].name}, NVLink3/NVSwitch, HDR InfiniBand "
                      "(datasheets)",
        }
    if name == "b200":
        return {
            "gpu": GPUS["b200"],
            "intra": NVLINK5,
            # DGX B200 datasheet: 8x ConnectX-7 400 Gb/s (OSFP) compute ports per node
            "inter": NDR_IB_PER_GPU,
            "intra_efficiency": dict(B200_INTRA_EFFICIENCY),
            "inter_efficiency": IB_EFFICIENCY,
            "base_latency": NCCL_BASE_LATENCY_S,
            "source": "DGX B200 nodes, NVLink5/NVSwitch, NDR InfiniBand (datasheets)",
        }
    if name == "cpu":
        return {
            "gpu": GPUS["cpu"],
            "intra": CPU_LOOPBACK,
            "inter": CPU_ETHERNET,
            "intra_efficiency": dict.fromkeys(COLLECTIVES, 1.0),
            "inter_efficiency": 1.0,
            "base_latency": 0.0,
            "source": "placeholder CPU profile; run `autopar calibrate` and use Cluster.local()",
        }
    raise KeyError(name)


PROFILES = ("h100", "h100-efa", "h200", "a100", "a100-80gb", "a100-40gb", "b200", "cpu")
# A profile name kept for what it meant before the A100 parts were split: the SXM4 80GB part.
PROFILE_ALIASES = {"a100": "a100-80gb"}
# What `Cluster(..., overrides={...})` may change of a named part (a power-capped or custom
# one), key -> what it is. Rates are per GPU, bandwidths payload bytes/s in one direction.
PART_OVERRIDES = {
    "peak_flops": "dense FLOP/s per dtype, merged over the datasheet's, e.g. {'bf16': 800e12}",
    "flops_scale": "a factor on every peak FLOP/s (a power cap's lower clocks), e.g. 0.8",
    "memory_bytes": "device memory in bytes, e.g. 64e9",
    "memory_bw": "device memory bandwidth in B/s",
    "matmul_efficiency": "fraction of the bf16 peak a large GEMM reaches (0-1]",
    "memory_efficiency": "fraction of memory_bw a large copy reaches (0-1]",
    "kernel_floor_s": "least seconds any kernel takes",
    "intra_bandwidth": "NVLink bytes/s per GPU, one direction",
    "intra_latency": "NVLink seconds per ring hop",
    "inter_bandwidth": "network bytes/s per GPU, one direction",
    "inter_latency": "network seconds per ring hop",
    "inter_efficiency": "achieved fraction of inter_bandwidth (0-1]",
    "base_latency": "seconds of fixed cost per collective call",
}
_FRACTIONS = ("matmul_efficiency", "memory_efficiency", "inter_efficiency")
_OVERRIDABLE = (
    "gpu",
    "intra",
    "inter",
    "busbw_curves",
    "curve_message_bytes",
    "curve_gpus_per_node",
    "intra_efficiency",
    "inter_efficiency",
    "base_latency",
    "collective_fits",
    "params",
    "fit_coverage",
    "host_share",
    "source",
)


def _check_count(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"Cluster({what}={value!r}): {what} must be an integer >= 1, e.g. {what}=1"
        )
    return value


@dataclass(init=False)
class Cluster:
    """A training cluster: ``nodes`` nodes of ``gpus_per_node`` GPUs of kind ``gpu``.

    ``Cluster(name="h100", nodes=1, gpus_per_node=8, overrides=None, **fields)`` starts from the
    named profile (``PROFILES``; "a100" is "a100-80gb"), replaces any field given as a keyword
    (``gpu`` may be a GPU name), then changes the part's numbers named in ``overrides``
    (`PART_OVERRIDES`: a power-capped or custom part, e.g.
    ``Cluster("h100", nodes=4, overrides={"flops_scale": 0.8, "memory_bytes": 64e9})``).

    intra / inter: the NVLink and the per-GPU network link.
    busbw_curves: kind -> [(nodes, busbw B/s)] measured at large messages (calibrated profiles),
        taken at ``curve_message_bytes`` with ``curve_gpus_per_node`` GPUs per node.
    intra_efficiency: achieved busbw / intra.bandwidth inside one node, per collective kind.
    inter_efficiency: achieved fraction of inter.bandwidth per NIC.
    base_latency: fixed cost of one collective call (seconds).
    collective_fits: per-kind alpha-beta fits measured by `autopar calibrate` (local only).
    params: the cost model's free parameters (`cost.params.CostParams`): defaults, or the fit
        of a profile file (`from_profile`; the shipped ``h100-efa`` profile is a fit).
    fit_coverage: for fitted parameters, the layout values the fit's runs had (field -> values;
        `cost.profile.coverage_notes` says where a layout leaves them).
    host_share: local CPU ranks that share one host's cores (`HostShare`); None for devices.
    """

    name: str
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link
    busbw_curves: dict[str, list[tuple[float, float]]] | None
    curve_message_bytes: float
    curve_gpus_per_node: int
    intra_efficiency: dict[str, float]
    inter_efficiency: float
    base_latency: float
    collective_fits: dict[str, CollectiveFit] | None
    params: CostParams
    fit_coverage: dict | None
    host_share: HostShare | None
    source: str

    def __init__(self, name: str = "h100", nodes: int = 1, gpus_per_node: int = 8,
                 overrides: dict | None = None, **replaced):
        key = str(name).lower()
        if key not in PROFILES:
            close = difflib.get_close_matches(key, PROFILES, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown cluster profile {name!r}; known: {list(PROFILES)}, or "
                f"Cluster.local() for this machine.{hint}"
            )
        unknown = set(replaced) - set(_OVERRIDABLE)
        if unknown:
            raise ValueError(
                f"Cluster(...) got unknown fields {sorted(unknown)}; "
                f"overridable: {list(_OVERRIDABLE)}"
            )
        values = {
            "busbw_curves": None,
            "curve_message_bytes": 0.0,
            "curve_gpus_per_node": 0,
            "collective_fits": None,
            "params": CostParams(),
            "fit_coverage": None,
            "host_share": None,
        }
        values.update(_profile(PROFILE_ALIASES.get(key, key)))
        values.update(replaced)
        if isinstance(values["gpu"], str):
            values["gpu"] = get_gpu(values["gpu"])
        if overrides:
            values.update(_apply_part_overrides(values, overrides))
        self._assign(name=key, nodes=nodes, gpus_per_node=gpus_per_node, **values)

    def _assign(self, **values) -> None:
        self.name = values["name"]
        self.nodes = _check_count("nodes", values["nodes"])
        self.gpus_per_node = _check_count("gpus_per_node", values["gpus_per_node"])
        for f in fields(self):
            if f.name not in ("name", "nodes", "gpus_per_node"):
                setattr(self, f.name, values[f.name])
        missing = set(COLLECTIVES) - set(self.intra_efficiency)
        if missing:
            raise ValueError(
                f"Cluster.intra_efficiency lacks {sorted(missing)}; give all of {COLLECTIVES}"
            )

    @property
    def world_size(self) -> int:
        """Total GPUs: nodes * gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def calibrated(self) -> bool:
        """Whether measured bus-bandwidth curves back this profile's network model."""
        return bool(self.busbw_curves)

    @classmethod
    def local(cls, path: str | os.PathLike | None = None, ranks: int | None = None,
              threads_per_rank: int | None = None) -> Cluster:
        """This machine, from ``autopar calibrate``'s file ($AUTOPAR_CALIBRATION or
        ``~/.cache/autopar/calibration.json``); without one, a CPU placeholder and a warning.

        Local ranks are processes on one host, so the cluster is one node whose "GPUs" are the
        ranks; each rank's memory is the host's RAM divided among them, and each rank's compute
        is its share of the host's cores (`rank_share`). ``ranks`` defaults to the world size
        the collectives were calibrated with; ``threads_per_rank`` to 1 when several ranks
        share the host (torchrun and autopar's spawn set OMP_NUM_THREADS=1), else the
        calibration's thread count.
        """
        source = Path(path) if path is not None else default_calibration_path()
        if not source.exists():
            warnings.warn(
                f"no calibration at {source}; using placeholder CPU numbers. Run "
                "`autopar calibrate` to measure this machine (or set $AUTOPAR_CALIBRATION).",
                stacklevel=2,
            )
            ranks = ranks or min(os.cpu_count() or 1, 4)  # local tests use 2-4 gloo ranks
            spec = GPUS["cpu"]
            spec = GPUSpec(**{**spec.to_dict(), "memory_bytes": _host_memory_bytes() / ranks})
            return cls("cpu", nodes=1, gpus_per_node=ranks, gpu=spec)._renamed("local")
        cal = load_calibration(source)
        ranks = ranks or cal.world_size
        memory = cal.memory_bytes if cal.memory_bytes is not None else _host_memory_bytes()
        where = f"`autopar calibrate` on {cal.host or 'this host'} {cal.date} ({source})"
        threads = cal.extra.get("raw", {}).get("threads", {})
        share, busy = 1.0, 1.0  # files without thread counts: each rank gets the measured rate
        host = None
        if threads.get("intra_op") and threads.get("cpu_count"):
            per_rank = threads_per_rank or (1 if ranks > 1 else threads["intra_op"])
            share, busy = rank_share(threads["intra_op"], threads["cpu_count"], ranks, per_rank)
            host = HostShare(int(threads["cpu_count"]), int(threads["intra_op"]), int(per_rank),
                             cal.pipeline_wait_per_compute)
        spec = GPUSpec(
            name="cpu-local",
            peak_flops={k: v * share for k, v in cal.matmul_flops.items()},
            memory_bytes=memory / ranks,
            memory_bw=cal.memory_bw * share,
            matmul_efficiency=1.0,  # measured rates are achieved rates already
            memory_efficiency=1.0,
            kernel_floor_s=cal.kernel_floor_s * busy,
            source=f"measured by {where}; each of {ranks} ranks gets {share:.2f} of the measured rates",
        )
        fits = dict(cal.collectives)
        if ranks != cal.world_size:
            # `cost.comm.latency` reads a fit as measured at gpus_per_node ranks: re-express the
            # measured latencies at this many ranks (scaled by ring steps, as comm does)
            fits = {kind: CollectiveFit(f.latency_s * ring_steps(kind, ranks, 1)[0]
                                        / max(1, ring_steps(kind, cal.world_size, 1)[0]), f.busbw)
                    for kind, f in fits.items()}
        best = max((f.busbw for f in fits.values()), default=CPU_LOOPBACK.bandwidth)
        ref = fits.get("all_reduce") or next(iter(fits.values()), None)
        # One ring hop of the reference fit: all-reduce has 2(n-1) hops.
        hop = ref.latency_s / max(1, 2 * (ranks - 1)) if ref else CPU_LOOPBACK.latency
        intra = Link(bandwidth=best, latency=hop, source=f"measured by {where}")
        efficiency = {k: (fits[k].busbw / best if k in fits else 1.0) for k in COLLECTIVES}
        return cls(
            "cpu",
            nodes=1,
            gpus_per_node=ranks,
            gpu=spec,
            intra=intra,
            intra_efficiency=efficiency,
            base_latency=0.0,
            collective_fits=fits,
            params=_local_params(cal),
            host_share=host,
            source=f"this machine, {where}",
        )._renamed("local")

    @classmethod
    def from_profile(cls, path: str | os.PathLike, nodes: int = 1,
                     gpus_per_node: int | None = None) -> Cluster:
        """The cluster of a fitted cost profile (`autopar calibrate --runs ... -o FILE`):
        its base profile's links and GPU with the fitted `CostParams`, at ``nodes`` nodes."""
        profile = load_profile(path)
        if profile.base not in PROFILES:
            raise ValueError(f"{path}: base profile {profile.base!r} is unknown; known: "
                             f"{list(PROFILES)}")
        per_node = gpus_per_node or int(profile.fit.get("gpus_per_node", 8))
        base = cls(profile.base, nodes=nodes, gpus_per_node=per_node)
        base.params = profile.params
        base.fit_coverage = profile.fit.get("coverage")
        base.source = f"{base.source}; cost parameters fitted in {path}"
        return base

    @classmethod
    def detect(cls, nodes: int | None = None) -> Cluster:
        """The cluster of the GPUs this process sees: their kind's profile (by device name),
        the GPUs per node (``LOCAL_WORLD_SIZE`` under torchrun, else the devices visible) and
        the nodes (``nodes``, else the process group's world size over the GPUs per node)."""
        import torch  # the cost model itself needs no torch; detection does
        import torch.distributed as dist

        if not torch.cuda.is_available():
            raise ValueError("Cluster.detect() found no CUDA device: on CPU ranks use "
                             "Cluster.local(), for planning name a profile: Cluster('h100', nodes=...)")
        device = torch.cuda.get_device_name(0).lower()
        # the profile of each GPU kind, matched on the name CUDA reports ("NVIDIA H100 80GB HBM3")
        known = {"h200": "h200", "h100": "h100", "b200": "b200", "a100": "a100-80gb"}
        name = next((v for k, v in known.items() if k in device), None)
        if name == "a100-80gb" and "80gb" not in device.replace(" ", ""):
            name = "a100-40gb"  # CUDA names the parts "A100-SXM4-40GB" / "A100-SXM4-80GB"
        if name is None:
            raise ValueError(f"Cluster.detect(): no profile for the GPU {device!r}; name one with "
                             f"Cluster(<profile>, nodes=...) (profiles: {', '.join(PROFILES)}) or fit "
                             "one with `autopar calibrate`")
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
        if nodes is None:
            world = dist.get_world_size() if dist.is_initialized() else per_node
            nodes = max(1, world // per_node)
            per_node = min(per_node, world)
        return cls(name, nodes=nodes, gpus_per_node=per_node)

    def _renamed(self, name: str) -> Cluster:
        self.name = name
        return self

    def price_key(self) -> tuple:
        """Everything a price depends on but the node count (hashable): memo keys of terms
        that see only groups inside the TP or pipeline axes."""
        curves = tuple(sorted((k, tuple(v)) for k, v in (self.busbw_curves or {}).items()))
        fits = tuple(sorted((self.collective_fits or {}).items()))
        gpu = self.gpu
        return (self.name, self.gpus_per_node, gpu.name, tuple(sorted(gpu.peak_flops.items())),
                gpu.memory_bw, gpu.memory_efficiency, gpu.matmul_efficiency, gpu.kernel_floor_s,
                gpu.attention_efficiency, gpu.native_attention_efficiency, gpu.attention_half_seq,
                self.intra, self.inter, tuple(sorted(self.intra_efficiency.items())),
                self.inter_efficiency, self.base_latency, curves, self.curve_message_bytes,
                self.curve_gpus_per_node, fits, self.params, self.host_share)

    def describe(self) -> str:
        """One line: profile, shape, GPU and links."""
        if self.collective_fits:
            net = "measured collectives"
        elif self.calibrated:
            net = "calibrated busbw curves"
        else:
            net = "parametric network model"
        return (
            f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} {self.gpu.name} "
            f"= {self.world_size} devices; intra {self.intra.bandwidth / 1e9:.0f} GB/s, "
            f"inter {self.inter.bandwidth / 1e9:.1f} GB/s per device ({net})"
        )

    def to_dict(self) -> dict:
        """JSON-safe dict of every field."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, GPUSpec):
                value = value.to_dict()
            elif isinstance(value, Link):
                value = {
                    "bandwidth": value.bandwidth,
                    "latency": value.latency,
                    "source": value.source,
                }
            elif f.name == "busbw_curves" and value is not None:
                value = {k: [list(p) for p in pts] for k, pts in value.items()}
            elif isinstance(value, CostParams):
                value = value.to_dict()
            elif isinstance(value, HostShare):
                value = asdict(value)
            elif f.name == "collective_fits" and value is not None:
                value = {k: {"latency_s": v.latency_s, "busbw": v.busbw} for k, v in value.items()}
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Cluster:
        """Inverse of `to_dict` (works for local and overridden clusters too)."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Cluster fields {sorted(unknown)}; known: {sorted(known)}")
        missing = known - set(data) - {"params", "fit_coverage", "host_share"}  # plans written before them
        if missing:
            raise ValueError(f"Cluster dict lacks {sorted(missing)}")
        values = dict(data)
        values["gpu"] = GPUSpec.from_dict(data["gpu"])
        values["intra"] = Link(**data["intra"])
        values["inter"] = Link(**data["inter"])
        if data["busbw_curves"] is not None:
            values["busbw_curves"] = {
                k: [(float(n), float(b)) for n, b in pts] for k, pts in data["busbw_curves"].items()
            }
        values["params"] = CostParams.from_dict(data.get("params") or {})
        values["fit_coverage"] = data.get("fit_coverage")
        values["host_share"] = HostShare(**data["host_share"]) if data.get("host_share") else None
        if data["collective_fits"] is not None:
            values["collective_fits"] = {
                k: CollectiveFit(**v) for k, v in data["collective_fits"].items()
            }
        obj = cls.__new__(cls)
        obj._assign(**values)
        return obj


def _apply_part_overrides(values: dict, overrides: dict) -> dict:
    """The ``gpu``, ``intra``, ``inter``, ``inter_efficiency``, ``base_latency`` and ``source``
    of a profile with the `PART_OVERRIDES` in ``overrides`` applied; ValueError naming an
    unknown key or a bad value and the valid keys."""
    if not isinstance(overrides, dict):
        raise ValueError(f"Cluster(overrides={overrides!r}): give a dict, e.g. "
                         "overrides={'flops_scale': 0.8}")
    unknown = sorted(set(overrides) - set(PART_OVERRIDES))
    if unknown:
        valid = "; ".join(f"{k}: {v}" for k, v in PART_OVERRIDES.items())
        raise ValueError(f"Cluster(overrides=...) got unknown keys {unknown}; valid keys: {valid}")
    for k, v in overrides.items():
        numbers = v.values() if k == "peak_flops" and isinstance(v, dict) else [v]
        for x in numbers:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 or x != x:
                raise ValueError(f"Cluster(overrides={{{k!r}: {v!r}}}): {k} must be a positive "
                                 f"number ({PART_OVERRIDES[k]})")
        if k in _FRACTIONS and v > 1:
            raise ValueError(f"Cluster(overrides={{{k!r}: {v!r}}}): {k} is a fraction in (0, 1]")
    if "peak_flops" in overrides and not isinstance(overrides["peak_flops"], dict):
        raise ValueError("Cluster(overrides={'peak_flops': ...}) takes a dict dtype -> FLOP/s, "
                         "e.g. {'bf16': 800e12}; to scale every rate use 'flops_scale'")
    gpu = values["gpu"].to_dict()
    peaks = {**gpu["peak_flops"], **{k: float(v) for k, v in
                                     overrides.get("peak_flops", {}).items()}}
    bad = sorted(set(peaks) - set(DTYPES))
    if bad:
        raise ValueError(f"Cluster(overrides={{'peak_flops': ...}}): unknown dtypes {bad}; "
                         f"use {list(DTYPES)}")
    scale = float(overrides.get("flops_scale", 1.0))
    gpu["peak_flops"] = {k: v * scale for k, v in peaks.items()}
    for k in ("memory_bytes", "memory_bw", "matmul_efficiency", "memory_efficiency",
              "kernel_floor_s"):
        if k in overrides:
            gpu[k] = float(overrides[k])
    said = ", ".join(f"{k}={v!r}" for k, v in sorted(overrides.items()))
    gpu["name"] = f"{gpu['name']} (overridden)"
    gpu["source"] = f"{gpu['source']}; overridden by the user: {said}"
    out = {"gpu": GPUSpec.from_dict(gpu), "source": f"{values['source']}; overrides: {said}"}
    for link in ("intra", "inter"):
        old = values[link]
        bw = float(overrides.get(f"{link}_bandwidth", old.bandwidth))
        lat = float(overrides.get(f"{link}_latency", old.latency))
        if (bw, lat) != (old.bandwidth, old.latency):
            old = Link(bw, lat, f"{old.source}; overridden by the user")
        out[link] = old
    for k in ("inter_efficiency", "base_latency"):
        out[k] = float(overrides.get(k, values[k]))
    return out


def _host_memory_bytes() -> float:
    """Physical RAM of this host from the OS (falls back to the CPU placeholder)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return GPUS["cpu"].memory_bytes


def rank_share(threads: int, cores: int, ranks: float, threads_per_rank: int) -> tuple[float, float]:
    """What one of ``ranks`` processes on a host of ``cores`` cores gets of rates calibrated by
    one process with ``threads`` threads: (rate factor, slow-down of single-threaded work).

    A rank runs ``threads_per_rank`` threads but the ranks time-share the cores, so it gets
    min(threads_per_rank, cores / ranks) cores at the calibrated per-core rate (the rate over
    min(threads, cores) busy cores; ``cores`` as os.cpu_count() reports them). Memory
    bandwidth is shared the same way. Measured on the 2-core dev box (4-layer h256
    Llama step, batch 4x128 per rank): 196 ms alone on one thread, 440 ms with 4 ranks running
    at once (model: 2 x 196 = 392 ms); calibrated 2-thread matmul 182 GFLOP/s, 1 thread 92.
    """
    cores_per_rank = min(float(threads_per_rank), cores / ranks)
    return cores_per_rank / min(threads, cores), max(1.0, ranks * threads_per_rank / cores)


def _local_params(cal: Calibration) -> CostParams:
    """The local cluster's `CostParams`: the defaults, with what the calibration measured (a
    pipeline transfer's overhead; what a collective beside compute costs it, where measured)."""
    params = CostParams().replace(p2p_overhead_s=cal.pipeline_overhead_s)
    slowdown = cal.overlap_slowdown
    return params if slowdown is None else params.replace(overlap_slowdown=slowdown)
