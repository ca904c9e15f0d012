"""A PEFT LoRA adapter planned against a Hugging Face base, for ``import-hf --adapter``
(issue 60): which base tensor each factor pair changes, by how much, or a refusal naming it.

The directory's files are read by the caller as untrusted input (``formats.safetensors_reader``'s
``HfDir``: containment, sizes, every safetensors header checked); this module judges what
they say, from metadata only:

- ``adapter_config.json`` (`settings`): ``peft_type`` ``LORA``; every setting that changes
  what PEFT's ``merge_and_unload`` computes and that a merge ``W + s·B@A`` cannot express
  is refused by name (DoRA, LoRA variants, trained biases, ``modules_to_save``, an init that
  rewrites the base such as PiSSA), and so is an unknown setting that is not empty;
- the factors (`plan_adapter`): ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and
  ``.lora_B.weight`` ``(out, r)``, each pair mapped to the base tensor ``<module>.weight``
  (through the family's file names where transformers 5 renames a module on load, mixtral's
  ``mlp`` saved as ``block_sparse_moe``), with PEFT's scale for that module: ``alpha/r``, or
  ``alpha/sqrt(r)`` with rsLoRA, ``r`` and ``alpha`` from ``rank_pattern``/``alpha_pattern``
  matched as PEFT 0.21.2's ``get_pattern_key`` matches them (the first pattern ``p``, in the
  file's order, with ``re.match(rf"(.*\\.)?({p})$", name)``). MoE experts that transformers 5
  keeps fused are adapted through ``target_parameters`` and saved under the fused module,
  one wrapper per parameter (`FUSED_EXPERTS`); each expert's slice of the pair changes that
  expert's tensors in the files.

Refused, every problem named at once: a key that is not a factor, a factor without its
partner, a module the base has no tensor for, a module the config does not target (PEFT
would not load it), factors whose shapes disagree with the module's rank or with the base
tensor (an adapter for another model or size), and non-float factors.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import LayoutMismatchError
from ..storage import transpose

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_FACTOR = re.compile(r"(?P<module>.+)\.lora_(?P<side>A|B)\.weight")
_WRAPPED = ".base_layer"  # PEFT's name for a wrapped module inside its LoRA wrapper
_SHOWN = 160  # a name or value from the input is shown (repr) up to this many characters

# Settings read, whatever their value (checked below where they matter).
READ = frozenset(
    {
        "peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
        "target_modules", "target_parameters", "exclude_modules", "layers_to_transform",
        "layers_pattern", "init_lora_weights", "base_model_name_or_path", "revision",
        "task_type", "peft_version", "inference_mode", "lora_dropout", "auto_mapping",
        "bias", "fan_in_fan_out", "qalora_group_size", "megatron_core", "loftq_config",
        "ensure_weight_tying",
    }
)  # fmt: skip
# Settings that change what PEFT's merge computes in a way ``W + s·B@A`` does not express:
# refused unless empty (None, False, {}, []).
REFUSED = {
    "use_dora": "DoRA rescales each column of the merged weight by a trained magnitude",
    "use_qalora": "QALoRA pools its input in groups",
    "use_bdlora": "BD-LoRA's factors are block-diagonal",
    "alora_invocation_tokens": "aLoRA applies only after its invocation tokens: no merge",
    "arrow_config": "Arrow routes between several adapters per token",
    "kasa_config": "KaSA is a LoRA variant",
    "velora_config": "VeLoRA is a LoRA variant",
    "monteclora_config": "MonteCLoRA is a LoRA variant",
    "lora_bias": "a trained lora_B bias",
    "modules_to_save": "whole modules saved with the adapter",
    "trainable_token_indices": "trained embedding rows saved with the adapter",
    "layer_replication": "layers duplicated in the model",
    "megatron_config": "Megatron's parallel layers",
    "corda_config": "CorDA rewrites the base weights at init",
    "eva_config": None,  # EVA only initialises A from data; the base is unchanged
    "lora_ga_config": "LoRA-GA rewrites the base weights at init",
}
# init_lora_weights whose adapter is a difference from the base as it was: the others (PiSSA,
# OLoRA, CorDA, LoftQ, LoRA-GA) rewrite the base at init, and a merge into the original base
# is then wrong unless PEFT converted the adapter when it saved it (its config then says True).
INITS = (True, False, "gaussian", "eva", "orthogonal")

# transformers 5 keeps a MoE layer's experts fused in memory (``mlp.experts.gate_up_proj``
# (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)) and saves them one tensor per expert;
# PEFT adapts the fused parameters (``target_parameters``). Per family (the base's
# ``model_type``): each fused parameter, in the order the experts module registers them, with
# the per-expert file tensors its rows split into (in that order), and the layer's name in
# the files. PEFT wraps each targeted parameter in one ``ParamWrapper``, the later ones outside
# the earlier: of k targeted parameters, the j-th (from 0) is saved under the module name
# with ``.base_layer`` k-1-j times (measured with PEFT 0.21.2 and transformers 5.24).
FUSED_EXPERTS: dict[str, tuple[str, tuple[tuple[str, tuple[str, ...]], ...]]] = {
    "mixtral": ("block_sparse_moe", (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",)))),
    "qwen3_moe": ("mlp", (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))),
}  # fmt: skip
# Where transformers 5 names a module otherwise in memory (PEFT's names) than in the files.
MODULE_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((".mlp.", ".block_sparse_moe."),),
}
FLOAT_DTYPES = frozenset(np.dtype(d) for d in ("float16", "float32", "float64", ml_dtypes.bfloat16))


class AdapterRefusedError(LayoutMismatchError):
    """A PEFT adapter refused before anything is written: a setting, a key or a shape that a
    merge into this base cannot take exactly, each named with why."""


def _q(value: object) -> str:
    r = repr(value)
    return r if len(r) <= _SHOWN else r[: _SHOWN - 3] + "..."


@dataclasses.dataclass(frozen=True)
class Settings:
    """What of ``adapter_config.json`` the merge uses."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: str | list[str] | None
    target_parameters: list[str]
    exclude_modules: str | list[str] | None
    layers_to_transform: int | list[int] | None
    layers_pattern: str | list[str] | None
    base_model: str | None
    random_init: bool = False  # init_lora_weights false: a targeted module PEFT finds no
    # factors for keeps nn.Linear's random init, a random change where B is not zero

    def rank_alpha(self, key: str) -> tuple[int, float]:
        """PEFT's rank and alpha of module (or parameter) ``key``: ``_create_and_replace``."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.alpha)
        return r, alpha

    def scale(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: Mapping[str, Any], key: str) -> str:
    """PEFT 0.21.2's ``get_pattern_key``: the first pattern matching the end of ``key`` at a
    dot, else ``key`` itself (then absent from the patterns)."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", key):
            return p
    return key


def _empty(value: Any) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def settings(config: Any, where: str) -> Settings:
    """``adapter_config.json`` (parsed) checked; `AdapterRefusedError` naming every setting
    that is malformed or that the merge cannot express."""
    if not isinstance(config, dict):
        raise AdapterRefusedError(f"{where}: not a JSON object; not a PEFT adapter config")
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(
            f"peft_type {_q(config.get('peft_type'))}: only LoRA (LORA) adapters are merged"
        )
    for key, value in config.items():
        if key in REFUSED and not _empty(value) and REFUSED[key]:
            problems.append(f"{key} {_q(value)}: {REFUSED[key]}; no merge W + s·B@A gives it")
        elif key not in READ and key not in REFUSED and not _empty(value):
            problems.append(
                f"{key} {_q(value)}: a setting this import does not know (a newer PEFT?)"
            )
    init = config.get("init_lora_weights", True)
    if not any(init is ok or (isinstance(ok, str) and init == ok) for ok in INITS):
        problems.append(
            f"init_lora_weights {_q(init)}: this init rewrites the base weights, so the "
            "adapter is not a difference from this base (save it with PEFT's "
            "path_initial_model_for_weight_conversion)"
        )
    for key, want in (("bias", "none"), ("fan_in_fan_out", False)):
        if config.get(key, want) != want:
            problems.append(f"{key} {_q(config[key])}: only {want!r} is merged")
    fields = _fields(config, problems)
    fields["random_init"] = init is False
    if problems:
        raise AdapterRefusedError(
            f"{where}: this PEFT adapter cannot be merged exactly:",
            problems,
            hint="Nothing was written.",
        )
    return Settings(**fields)


def _fields(config: dict, problems: list[str]) -> dict[str, Any]:
    """The typed fields of `Settings`; a malformed one is a problem, its field a default."""

    def get(key: str, ok: Callable[[Any], bool], default: Any, what: str) -> Any:
        value = config.get(key, default)
        if ok(value):
            return value
        problems.append(f"{key} {_q(value)}: not {what}")
        return default

    return {
        "r": get("r", _rank, 8, "a positive integer"),
        "alpha": get("lora_alpha", _number, 8, "a finite number"),
        "use_rslora": get("use_rslora", lambda v: isinstance(v, bool), False, "true or false"),
        "rank_pattern": get(
            "rank_pattern", lambda v: _patterns(v, _rank), {}, "patterns to positive ranks"
        ),
        "alpha_pattern": get(
            "alpha_pattern", lambda v: _patterns(v, _number), {}, "patterns to finite numbers"
        ),
        "target_modules": get(
            "target_modules",
            lambda v: v is None or (isinstance(v, str) and _regex(v)) or _names(v),
            None,
            "a regular expression or a list of names",
        ),
        "target_parameters": get(
            "target_parameters", lambda v: v is None or _names(v), None, "a list of names"
        )
        or [],
        "exclude_modules": get(
            "exclude_modules",
            lambda v: v is None or (isinstance(v, str) and _regex(v)) or _names(v),
            None,
            "a regular expression or a list of names",
        ),
        "layers_to_transform": get(
            "layers_to_transform",
            lambda v: (
                v is None
                or isinstance(v, int)
                or (isinstance(v, list) and all(isinstance(x, int) for x in v))
            ),
            None,
            "a layer index or a list of them",
        ),
        "layers_pattern": get(
            "layers_pattern", lambda v: v is None or isinstance(v, str) or _names(v), None, "names"
        ),
        "base_model": get(
            "base_model_name_or_path", lambda v: v is None or isinstance(v, str), None, "a name"
        ),
    }


def _rank(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _patterns(v: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(v, dict) and all(_regex(k) and ok(x) for k, x in v.items())


def _regex(p: Any) -> bool:
    """Whether ``p`` is a regular expression Python compiles (PEFT matches with ``re``)."""
    if not isinstance(p, str) or len(p) > 4096:
        return False
    try:
        re.compile(p)
    except (re.error, RecursionError, OverflowError):
        return False
    return True


# float32 bytes of a merge's block of rows (`AdapterPlan.merge`): its passes stay in cache
MERGE_BLOCK = 1 << 20


# -- the factors against the base ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Delta:
    """What one base tensor gets: ``scale · B @ A`` of the pair ``a``, ``b`` (file names), for
    a fused experts parameter the slice of expert ``expert`` of ``experts`` (PEFT's
    ``ParamWrapper``: A ``(E·r, in)`` expert-major, B ``(out, r·E)`` expert-minor), and of
    that the rows ``rows`` (this tensor's part of a fused ``gate_up_proj``)."""

    module: str  # PEFT's name: the module, or ``<module>.<parameter>`` of a fused one
    a: str
    b: str
    rank: int
    alpha: float
    scale: float
    experts: int = 0  # 0: a plain module
    expert: int = 0
    rows: tuple[int, int] | None = None

    def factors(self, read: Callable[[str], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``(B, A)`` of this tensor, float32: an expert's of a fused pair, its rows' part."""
        a = np.asarray(read(self.a), np.float32)
        b = np.asarray(read(self.b), np.float32)
        if self.experts:
            a = a.reshape(self.experts, self.rank, a.shape[-1])[self.expert]
            b = b.reshape(b.shape[0], self.rank, self.experts)[:, :, self.expert]
        if self.rows is not None:
            b = b[self.rows[0] : self.rows[1]]  # rows of a product are its rows of B
        return b, a

    def compute(
        self, read: Callable[[str], np.ndarray], out: np.ndarray | None = None
    ) -> np.ndarray:
        """The float32 delta, the base tensor's shape, as PEFT's ``get_delta_weight``
        computes it in float32: ``(B @ A) * scaling``; into ``out`` where given (a float32
        buffer of that shape, C order)."""
        b, a = self.factors(read)
        d = np.matmul(b, a, out=out)
        d *= np.float32(self.scale)
        return d


@dataclasses.dataclass
class AdapterPlan:
    """An adapter planned against a base: each base tensor it changes, with its `Delta`."""

    where: str
    settings: Settings
    deltas: dict[str, Delta]

    @property
    def modules(self) -> list[str]:
        return sorted({d.module for d in self.deltas.values()})

    def merge(
        self,
        name: str,
        w: np.ndarray,
        read: Callable[[str], np.ndarray],
        *,
        dtype: Any = np.float32,
        in_place: bool = False,
    ) -> np.ndarray:
        """Base tensor ``name`` with its delta added in float32 (PEFT's merge of a float32
        base: ``W + (B @ A) * s``), each sum rounded once to ``dtype`` (float32: as it is;
        bfloat16: to nearest even, as casting the float32 sum); or ``w`` itself where the
        adapter leaves it. ``in_place``: into ``w`` where it is of ``dtype`` and writable
        (the caller's own buffer), else a new array.

        A block of rows at a time (`MERGE_BLOCK` bytes of float32), each product, scale and
        sum made in cache: the whole float32 delta, its sum and their cast took 0.6 to 0.9 s
        of CPU an 8B MLP weight, in fresh memory three times the weight's float32 size, where
        the blocks take 0.13 s and one block. A bfloat16 weight merged into bfloat16 takes
        its scale, sum and cast in one compiled pass (`storage.transpose.add_scaled_bf16`,
        bit for bit NumPy's), where it was built."""
        delta = self.deltas.get(name)
        if delta is None:
            return w
        b, a = delta.factors(read)
        dtype = np.dtype(dtype)
        own = in_place and w.dtype == dtype and w.flags.writeable and w.flags.c_contiguous
        out = w if own else np.empty(w.shape, dtype)
        rows = max(1, MERGE_BLOCK // max(1, 4 * w.shape[-1]))
        block = np.empty((min(rows, len(w)), w.shape[-1]), np.float32)
        scale = np.float32(delta.scale)
        for lo in range(0, len(w), rows):
            src, dst = w[lo : lo + rows], out[lo : lo + rows]
            d = np.matmul(b[lo : lo + rows], a, out=block[: len(src)])
            if transpose.add_scaled_bf16(dst, d, src, scale):  # compiled: the next 3 lines
                continue
            d *= scale
            d += src  # float32 + any float source: one rounding, in float32
            dst[...] = d  # rounded once more where ``dtype`` is narrower
        return out

    def held(self, name: str, nbytes_f32: int) -> int:
        """Bytes a merge of ``name`` holds besides its source and what it is cast to: its
        block (`merge`) and its factors."""
        return min(nbytes_f32, MERGE_BLOCK) if name in self.deltas else 0

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        ranks = sorted({d.rank for d in self.deltas.values()})
        scales = sorted({d.scale for d in self.deltas.values()})
        return {
            "adapter": self.where,
            "base_model_name_or_path": s.base_model,
            "r": s.r,
            "lora_alpha": s.alpha,
            "use_rslora": s.use_rslora,
            "ranks": ranks,
            "scales": scales,
            "modules": len(self.modules),
            "tensors": len(self.deltas),
        }


def plan_adapter(
    s: Settings,
    factors: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    base: Mapping[str, tuple[int, ...]],
    *,
    model_type: str,
    where: str,
) -> AdapterPlan:
    """Every factor pair of ``factors`` (file name -> shape, dtype) mapped onto the base
    tensors ``base`` (name -> shape: those the import reads) of a ``model_type`` model, or
    `AdapterRefusedError` naming every problem."""
    problems: list[str] = []
    pairs = _pairs(factors, problems)
    deltas: dict[str, Delta] = {}
    job = _PairPlanning(s, base, model_type, problems)
    fused = FUSED_EXPERTS.get(model_type)
    for module, (a, b) in sorted(pairs.items()):
        pair = _Pair(a, b, tuple(factors[a][0]), tuple(factors[b][0]))
        for side, name in (("lora_A", a), ("lora_B", b)):
            if np.dtype(factors[name][1]) not in FLOAT_DTYPES:
                problems.append(f"{name}: {np.dtype(factors[name][1])}, not a float {side}")
        bare, depth = _unwrap(module)
        if fused and bare.endswith(".experts") and (depth or _fused_targets(s, bare, fused)):
            made = _fused(job, bare, depth, pair, fused)
        elif depth:
            problems.append(f"{module}: a wrapped module that is no fused experts parameter")
            continue
        else:
            made = _plain(job, bare, pair)
        for name, delta in made.items():
            if name in deltas:
                problems.append(f"{name}: changed by both {deltas[name].module} and {delta.module}")
            deltas[name] = delta
    problems += _unfactored(s, pairs, base, model_type)
    if not pairs and not problems:
        problems.append("no LoRA factors (lora_A/lora_B) at all")
    if problems:
        raise AdapterRefusedError(
            f"{where}: this PEFT adapter does not fit the base model:",
            problems,
            hint="Nothing was written. Pass the adapter's own base model (and MaxText config).",
        )
    return AdapterPlan(where, s, deltas)


@dataclasses.dataclass(frozen=True)
class _PairPlanning:
    """What planning each pair needs: the settings, the base tensors, the family, and the
    list every problem goes to."""

    s: Settings
    base: Mapping[str, tuple[int, ...]]
    model_type: str
    problems: list[str]


@dataclasses.dataclass(frozen=True)
class _Pair:
    a: str
    b: str
    sa: tuple[int, ...]
    sb: tuple[int, ...]


def _unfactored(
    s: Settings, pairs: Mapping[str, Any], base: Mapping[str, tuple[int, ...]], model_type: str
) -> list[str]:
    """With ``init_lora_weights`` false, the base's modules the config targets and the file
    holds no factors for: PEFT would give each a random change (`Settings.random_init`)."""
    if not s.random_init:
        return []  # B starts at zero (or B @ A at zero, orthogonal): no change
    out = []
    for name, shape in base.items():
        if len(shape) != 2 or not name.endswith(".weight") or ".experts." in name:
            continue
        module = name[: -len(".weight")]
        for ours, theirs in MODULE_RENAMES.get(model_type, ()):
            module = module.replace(theirs, ours)  # PEFT's (in-memory) name
        if _targeted(s, module) and module not in pairs:
            out.append(
                f"{module}: targeted, with init_lora_weights false, but no factors in the "
                "file: PEFT would give it a random change"
            )
    return out


def _pairs(factors: Mapping[str, Any], problems: list[str]) -> dict[str, tuple[str, str]]:
    """Module -> (its lora_A, its lora_B file names); anything else a problem."""
    sides: dict[str, dict[str, str]] = {}
    for name in factors:
        m = _FACTOR.fullmatch(name[len(PREFIX) :]) if name.startswith(PREFIX) else None
        if m is None:
            problems.append(f"{_q(name)}: not a LoRA factor PEFT's merge applies ({_what(name)})")
            continue
        sides.setdefault(m["module"], {})[m["side"]] = name
    out = {}
    for module, got in sides.items():
        if set(got) != {"A", "B"}:
            (has,) = got
            problems.append(f"{module}: lora_{has} without lora_{'B' if has == 'A' else 'A'}")
        else:
            out[module] = (got["A"], got["B"])
    return out


def _what(name: str) -> str:
    """Why a key that is not ``lora_A``/``lora_B.weight`` is refused, as far as it tells."""
    if "lora_magnitude_vector" in name:
        return "DoRA's magnitude"
    if "lora_embedding_" in name:
        return "an embedding adapter: not supported"
    if ".lora_B.bias" in name:
        return "a lora_B bias"
    if "modules_to_save" in name or not name.startswith(PREFIX):
        return "a whole module or another kind of tensor"
    return "an unknown tensor"


def _unwrap(module: str) -> tuple[str, int]:
    depth = 0
    while module.endswith(_WRAPPED):
        module, depth = module[: -len(_WRAPPED)], depth + 1
    return module, depth


def _plain(job: _PairPlanning, module: str, pair: _Pair) -> dict[str, Delta]:
    """A module's pair onto its base tensor ``<module>.weight`` (as the files name it)."""
    s, base, problems = job.s, job.base, job.problems
    a, b, sa, sb = pair.a, pair.b, pair.sa, pair.sb
    if not _targeted(s, module):
        problems.append(f"{module}: has factors, but target_modules does not target it")
        return {}
    names = [module + ".weight"]
    for ours, theirs in MODULE_RENAMES.get(job.model_type, ()):
        names.append(names[0].replace(ours, theirs))
    tensor = next((n for n in names if n in base), None)
    if tensor is None:
        problems.append(f"{module}: the base has no tensor {names[-1]} that MaxText reads")
        return {}
    r, alpha = s.rank_alpha(module)
    want = base[tensor]
    if len(want) != 2 or sa != (r, want[1]) or sb != (want[0], r):
        problems.append(
            f"{module}: lora_A {list(sa)}, lora_B {list(sb)}; rank {r} over the base's "
            f"{tensor} {list(want)} needs lora_A {[r, want[-1]]}, lora_B {[want[0], r]}"
        )
        return {}
    return {tensor: Delta(module, a, b, r, alpha, s.scale(r, alpha))}


def _fused_targets(s: Settings, module: str, fused: tuple) -> list[str]:
    """The fused experts parameters of ``module`` ``target_parameters`` targets, in the
    order the experts module registers them (PEFT's ``_inject_parameters``)."""
    out = []
    for param, _ in fused[1]:
        key = f"{module}.{param}"
        if any(key == t or key.endswith("." + t) for t in s.target_parameters):
            out.append(param)
    return out


def _fused(
    job: _PairPlanning, module: str, depth: int, pair: _Pair, fused: tuple
) -> dict[str, Delta]:
    """A fused experts parameter's pair onto each expert's tensors in the files."""
    s, base, problems = job.s, job.base, job.problems
    a, b, sa, sb = pair.a, pair.b, pair.sa, pair.sb
    targets = _fused_targets(s, module, fused)
    if depth >= len(targets):
        problems.append(
            f"{module}{_WRAPPED * depth}: target_parameters targets {len(targets)} of this "
            "module's parameters, so nothing is saved under this name"
        )
        return {}
    param = targets[len(targets) - 1 - depth]
    parts = dict(fused[1])[param]
    prefix = module[: -len("mlp.experts")] + fused[0] + ".experts"
    experts = 0
    while f"{prefix}.{experts}.{parts[0]}.weight" in base:
        experts += 1
    names = [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(experts)]
    shapes = [base.get(n) for row in names for n in row]
    if not module.endswith("mlp.experts") or not experts or None in shapes:
        problems.append(f"{module}.{param}: the base has no experts {prefix}.<e>.{parts[0]}")
        return {}
    rows = [base[n][0] for n in names[0]]
    width = {sh[1] for sh in shapes if len(sh) == 2}
    r, alpha = s.rank_alpha(f"{module}.{param}")
    want_a, want_b = (r * experts, *width), (sum(rows), r * experts)
    if len(width) != 1 or any(len(sh) != 2 for sh in shapes) or (sa, sb) != (want_a, want_b):
        problems.append(
            f"{module}.{param}: lora_A {list(sa)}, lora_B {list(sb)}; rank {r} over "
            f"{experts} experts of {list(base[names[0][0]])} x {len(parts)} needs lora_A "
            f"{list(want_a)}, lora_B {list(want_b)}"
        )
        return {}
    out = {}
    for e in range(experts):
        lo = 0
        for name, n in zip(names[e], rows, strict=True):
            scale = s.scale(r, alpha)
            out[name] = Delta(f"{module}.{param}", a, b, r, alpha, scale, experts, e, (lo, lo + n))
            lo += n
    return out


def _targeted(s: Settings, key: str) -> bool:
    """Whether PEFT 0.21.2 puts a LoRA layer on module ``key`` for this config
    (``check_target_module_exists``): a module it does not target would not load."""
    ex = s.exclude_modules
    if ex and (
        re.fullmatch(ex, key)
        if isinstance(ex, str)
        else key in ex or any(key.endswith("." + e) for e in ex)
    ):
        return False
    tm = s.target_modules
    if tm is None:
        return False
    if isinstance(tm, str):
        if tm.lower() == "all-linear":  # expanded by PEFT when made; every linear but the output
            return key.rsplit(".", 1)[-1] != "lm_head"
        return re.fullmatch(tm, key) is not None
    if key in tm:
        return True
    if not any(key.endswith("." + t) for t in tm):
        return False
    layers = s.layers_to_transform
    if layers is None or layers == []:
        return True
    pats = s.layers_pattern
    if not pats:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = next(
            (
                hit
                for p in ([pats] if isinstance(pats, str) else pats)
                if (hit := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key))
            ),
            None,
        )
    if m is None:
        return False
    return int(m["idx"]) == layers if isinstance(layers, int) else int(m["idx"]) in layers
