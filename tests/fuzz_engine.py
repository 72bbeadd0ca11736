"""Random-schedule fuzzer: packgraph graph engine (CPU stand-in recorders) vs eager autograd.

Usage: python -m tests.fuzz_engine SEED_START SEED_END [OUT_DIR] (from the repository root; not a pytest file)
A seed determines a config and a program (list of ops). Both sides (graph, eager) run the same ops; after every
op every held pair of tensors is compared, after backward ops every .grad too.
"""

import copy
import json
import logging
import random
import sys
import time
import traceback
import warnings

import torch
from torch import nn

import packgraph.graphs.entry as entry_module
import packgraph.graphs.memory as memory_module
from packgraph.buckets import BucketPolicy, default_buckets
from packgraph.graphs import GraphCaptureError, GraphOrderError, GraphSignatureError
from packgraph.graphs.capture import capture_layers_with, capture_with
from packgraph.models.gpt import Block, GPTConfig
from packgraph.params import PackedSeqParams, PackedSeqParamsError
from tests.eager_recorder import CaptureLikeRecorder, EagerRecorder, OpReplayRecorder

logging.disable(logging.CRITICAL)
warnings.filterwarnings("ignore")
torch.set_num_threads(1)

D = 32
EXCLUDE = set(a.split("=")[1] for a in sys.argv if a.startswith("--exclude=")) if False else set()
for a in sys.argv:
    if a.startswith("--exclude="):
        EXCLUDE |= set(a.split("=", 1)[1].split(","))
TS = [48, 40]
RECORDERS = {"eager": EagerRecorder, "op": OpReplayRecorder, "capturelike": CaptureLikeRecorder}
ORIG_COPIED = entry_module.COPIED_OUTPUT_BYTES
ORIG_SWAP = memory_module.SWAP_DATA_PTR
PACKGRAPH_ERRORS = (GraphOrderError, GraphSignatureError, GraphCaptureError, PackedSeqParamsError)


class Mismatch(AssertionError):
    pass


# ------------------------------------------------------------------------------------------------------ config
def make_config(rng):
    cfg = {
        "rec": rng.choice(["eager", "op", "op", "capturelike"]),
        "handout": rng.choice(["copy", "swap", "scan"]),
        "kind": rng.choice(["chained", "chained", "unchained", "single_block", "single_seq"]),
        "nlayers": rng.choice([1, 2, 3]),
        "max_graphs": rng.choice([None, None, 1, 2, 3]),
        "share": rng.random() < 0.7,
        "recompute": rng.random() < 0.3,
        "buckets": rng.choice([None, "default", "custom"]),
        "scorer": rng.random() < 0.5,
        "emb": rng.random() < 0.5,
        "head": rng.random() < 0.5,
        "mid": rng.random() < 0.2,  # an eager op between layers (unchained input for chained stacks)
        "warmup": rng.choice([1, 2, 3]),
    }
    if cfg["kind"] == "single_block":
        cfg["nlayers"] = 1
    return cfg


def policy_of(name):
    if name == "default":
        return default_buckets(48)
    if name == "custom":
        return BucketPolicy((16, 48), (4, 12, 48))
    return None


# ------------------------------------------------------------------------------------------------------ modules
def block(seed):
    torch.manual_seed(seed)
    return Block(GPTConfig(d_model=D, n_head=4, n_layer=2, vocab_size=50)).double()


class Seq(nn.Module):
    def __init__(self, layers, mid):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.mid = mid

    def forward(self, x, p):
        for k, layer in enumerate(self.layers):
            x = layer(x, p)
            if self.mid and k + 1 < len(self.layers):
                x = x * 0.75
        return x


def x_leaf(seed, t, rg):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, D, dtype=torch.float64, generator=g).requires_grad_(rg)


def loss_of(out):
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return (out * w).sum()


def make_params(spec):
    lengths, cap, t, ms = spec
    return PackedSeqParams.from_seqlens(lengths, capacity=cap, total_tokens=t, max_seqlen=ms)


class Side:
    """One side of the comparison: the modules, callables and values of its program run."""

    def __init__(self, cfg, graphed):
        self.cfg = cfg
        self.graphed = graphed
        self.vals = {}
        self.handles = {}
        self.P = None  # a params object reused across calls and layers, modified in place
        self.hook_log = []

    # the modules
    def all_modules(self):
        mods = list(self.layers)
        if self.emb is not None:
            mods.append(self.emb)
        if self.head is not None:
            mods.append(self.head)
        return mods

    def named_params(self):
        out = []
        for i, m in enumerate(self.all_modules()):
            for n, p in m.named_parameters():
                out.append((f"{i}.{n}", p))
        return out


def build(cfg, seed):
    """(graph side, eager side). The eager side is a deep copy of the modules before capture."""
    torch.manual_seed(1000 + seed)
    layers = [block(seed * 10 + k) for k in range(cfg["nlayers"])]
    emb = nn.Linear(D, D).double() if cfg["emb"] else None
    head = nn.Linear(D, D).double() if cfg["head"] else None
    ref_layers = copy.deepcopy(layers)
    ref_emb, ref_head = copy.deepcopy(emb), copy.deepcopy(head)
    g, e = Side(cfg, True), Side(cfg, False)
    g.layers, g.emb, g.head = layers, emb, head
    e.layers, e.emb, e.head = ref_layers, ref_emb, ref_head
    if cfg["kind"] == "single_seq":
        g.seq, e.seq = Seq(layers, cfg["mid"]), Seq(ref_layers, cfg["mid"])
    # capture
    if cfg["handout"] == "copy":
        entry_module.COPIED_OUTPUT_BYTES = ORIG_COPIED
        memory_module.SWAP_DATA_PTR = ORIG_SWAP
    else:
        entry_module.COPIED_OUTPUT_BYTES = 0
        memory_module.SWAP_DATA_PTR = cfg["handout"] == "swap"
    rec = RECORDERS[cfg["rec"]]
    policy = policy_of(cfg["buckets"])
    sample = (x_leaf(0, 48, True), make_params(([12, 3], 8, 48, 48)))
    opts = dict(
        max_graphs=cfg["max_graphs"],
        share_activations=cfg["share"],
        recompute=cfg["recompute"],
        num_warmup_iters=cfg["warmup"],
    )
    if cfg["kind"] in ("chained", "unchained"):
        g.stack = capture_layers_with(rec(), layers, sample, chain=cfg["kind"] == "chained", buckets=policy, **opts)
    elif cfg["kind"] == "single_block":
        g.stack = [capture_with(rec(), layers[0], sample, buckets=policy, **opts)]
    else:
        g.stack = [capture_with(rec(), g.seq, sample, buckets=policy, **opts)]
    e.stack = [e.seq] if cfg["kind"] == "single_seq" else e.layers
    g.scorer = None
    if cfg["scorer"]:
        sample_ng = (x_leaf(0, 48, False), make_params(([12, 3], 8, 48, 48)))
        if cfg["kind"] == "single_seq":
            g.scorer = [capture_with(rec(), g.seq, sample_ng, buckets=policy, forward_only=True)]
        else:
            g.scorer = capture_layers_with(
                rec(), layers, sample_ng, chain=cfg["kind"] == "chained", buckets=policy, forward_only=True
            )
    e.scorer = e.stack
    return g, e


# ------------------------------------------------------------------------------------------------------ program
LENGTHS = [[40], [10, 20, 5], [3] * 10, [1] * 30, [24, 24], [2] * 20, [7, 9, 11], [12, 3], [5], [30, 4]]


def rand_pspec(rng, cfg, t):
    while True:
        lengths = rng.choice(LENGTHS)
        if sum(lengths) <= t:
            break
    if cfg["buckets"]:
        cap = len(lengths) + rng.choice([0, 0, 1, 3])
        ms = rng.choice([t, max(lengths)])
    else:
        cap = next(c for c in (4, 8, 16, 32, 48) if c >= len(lengths))
        ms = t
    return [lengths, cap, t, ms]


def side_call(rng, cfg, t, fwd, name, seed, *, grad=False, scorer=None, hold=None, maybe_scorer=False):
    """A call between a forward and its backward: ``fwd``'s settings on other params and inputs, no hooks, no
    retained output; without ``grad`` under no_grad on an input that needs none. Draws from ``rng`` in one order
    (params, then ``hold``, then ``maybe_scorer``), so that a seed keeps its program."""
    op = dict(fwd, name=name, seed=seed, grad=grad, shared_P=False, pspec=rand_pspec(rng, cfg, t))
    op.update(hold=rng.random() < 0.5 if hold is None else hold, retain_out=False, hook_hidden=False)
    if not grad:
        op["xmode"] = "nograd_leaf"
    if scorer is not None:
        op["scorer"] = scorer
    if maybe_scorer:
        op["scorer"] = cfg["scorer"] and rng.random() < 0.5
    return ["fwd", op]


def gen_program(rng, cfg, nsteps):
    ops = []
    n = 0
    for _step in range(nsteps):
        r = rng.random()
        if r < 0.3:
            ops.append(
                [
                    "mutate",
                    rng.choice(
                        [
                            "freeze",
                            "freeze",
                            "train",
                            "fhook",
                            "fhook_rm",
                            "reassign",
                            "load_sd",
                            "grad_hook",
                            "grad_hook_rm",
                            "post_hook",
                            "modify_P",
                            "modify_P_data",
                        ]
                    ),
                    rng.randrange(1 << 30),
                ]
            )
        if rng.random() < 0.8:
            ops.append(["zero", rng.random() < 0.6])
        nmb = rng.choice([1, 1, 2, 3])
        pending = []
        for mb in range(nmb):
            n += 1
            name = f"o{n}"
            t = 48 if rng.random() < 0.8 else 40
            fwd = {
                "name": name,
                "seed": n,
                "t": t,
                "xmode": rng.choice(["leaf", "leaf", "nograd_leaf", "emb"])
                if cfg["emb"]
                else rng.choice(["leaf", "leaf", "nograd_leaf"]),
                "pspec": rand_pspec(rng, cfg, t),
                "shared_P": rng.random() < 0.25,
                "grad": True,
                "retain_out": rng.random() < 0.2,
                "hook_hidden": rng.random() < 0.2,
                "hold": rng.random() < 0.4,
            }
            ops.append(["fwd", fwd])
            pending.append(name)
            # something in between a forward and its backward
            r = rng.random()
            if "polite" in EXCLUDE:
                r = 1.0
            if r < 0.1:
                ops.append(side_call(rng, cfg, t, fwd, name + "s", n + 5000))
            elif r < 0.18 and cfg["scorer"]:
                ops.append(side_call(rng, cfg, t, fwd, name + "c", n + 6000, scorer=True))
            elif r < 0.22 and cfg["scorer"] and "scorer_grad" not in EXCLUDE:  # the scorer called with grad enabled
                ops.append(side_call(rng, cfg, t, fwd, name + "cg", n + 6000, scorer=True, grad=True, hold=False))
                ops.append(["bwd", name + "cg", "backward"])
            if rng.random() < 0.6 or mb == nmb - 1 or "polite" in EXCLUDE:
                # backward of everything pending (usually just this one), most recent first or not
                order = pending[::-1] if rng.random() < 0.7 else pending[:]
                for pname in order:
                    mode = rng.choice(
                        [
                            "backward",
                            "backward",
                            "backward",
                            "grad_x",
                            "grad_params",
                            "inputs",
                            "retain_twice",
                            "retain_then",
                        ]
                    )
                    if mode in EXCLUDE:
                        mode = "backward"
                    ops.append(["bwd", pname, mode])
                    if mode == "retain_then":
                        # a no-grad call then the second backward
                        ops.append(side_call(rng, cfg, t, fwd, pname + "r", n + 7000, hold=False, maybe_scorer=True))
                        ops.append(["bwd_again", pname])
                pending = []
        if rng.random() < 0.3:
            ops.append(["sgd"])
        if rng.random() < 0.4:
            n += 1
            t = 48 if rng.random() < 0.8 else 40
            ops.append(
                [
                    "fwd",
                    {
                        "name": f"s{n}",
                        "seed": n + 9000,
                        "t": t,
                        "xmode": "nograd_leaf",
                        "pspec": rand_pspec(rng, cfg, t),
                        "shared_P": rng.random() < 0.3,
                        "grad": False,
                        "retain_out": False,
                        "hook_hidden": False,
                        "hold": rng.random() < 0.5,
                        "scorer": cfg["scorer"] and rng.random() < 0.5,
                    },
                ]
            )
        if rng.random() < 0.3:
            ops.append(["drop_all"])
        ops.append(["check_grads"])
    return ops


# ------------------------------------------------------------------------------------------------------ ops
def get_P(side, spec):
    if side.P is None:
        side.P = make_params(spec)
    return side.P


def op_fwd(side, spec):
    cfg = side.cfg
    t = spec["t"]
    if spec["shared_P"]:
        p = get_P(side, spec["pspec"])
        if p.total_tokens != t:
            t = p.total_tokens
    else:
        p = make_params(spec["pspec"])
    grad = spec["grad"]
    leaf = x_leaf(spec["seed"], t, spec["xmode"] in ("leaf",) and grad)
    x = side.emb(leaf) if spec["xmode"] == "emb" and side.emb is not None else leaf
    use_scorer = spec.get("scorer") and side.scorer is not None
    stack = side.scorer if use_scorer else side.stack
    kept = []
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        h = x
        for k, layer in enumerate(stack):
            h = layer(h, p)
            if cfg["mid"] and cfg["kind"] != "single_seq" and k + 1 < len(stack):
                h = h * 0.75
            if spec["hook_hidden"] and h.requires_grad and k + 1 < len(stack):
                h.register_hook(lambda gr, kept=kept: kept.append(gr))
        out = side.head(h) if side.head is not None else h
        if spec["retain_out"] and h.requires_grad:
            h.retain_grad()
    side.vals[spec["name"]] = {"leaf": leaf, "x": x, "h": h, "out": out, "kept": kept, "spec": spec, "p": p}
    return out


def pairs_of_val(gv, ev):
    return [("out", gv["out"], ev["out"])]


def op_bwd(side, name, mode):
    v = side.vals.get(name)
    if v is None:
        return None
    out = v["out"]
    if not out.requires_grad:
        return "nograd"
    loss = loss_of(out)
    res = []
    trainable = [p for _, p in side.named_params() if p.requires_grad]
    leaf = v["leaf"]
    if mode == "backward":
        loss.backward()
    elif mode == "grad_x":
        targets = [leaf] if leaf.requires_grad else trainable[:1]
        if targets:
            res = list(torch.autograd.grad(loss, targets, allow_unused=True))
    elif mode == "grad_params":
        sub = trainable[: max(1, len(trainable) // 3)]
        if sub:
            res = list(torch.autograd.grad(loss, sub, allow_unused=True))
    elif mode == "inputs":
        inputs = ([leaf] if leaf.requires_grad else []) + trainable[::2]
        if inputs:
            loss.backward(inputs=inputs)
    elif mode == "retain_twice":
        loss.backward(retain_graph=True)
        loss.backward()
    elif mode == "retain_then":
        loss.backward(retain_graph=True)
        v["loss"] = loss
    v["res"] = res
    return None


def op_bwd_again(side, name):
    v = side.vals.get(name)
    if v is None or "loss" not in v:
        return
    v.pop("loss").backward()


def op_mutate(side, kind, seed):
    rng = random.Random(seed)
    layers = side.layers
    k = rng.randrange(len(layers))
    layer = layers[k]
    names = [n for n, _ in layer.named_parameters()]
    pname = rng.choice(names)
    mods = dict(layer.named_modules())
    if kind == "freeze":
        p = dict(layer.named_parameters())[pname]
        p.requires_grad_(not p.requires_grad)
    elif kind == "train":
        sub = rng.choice(["", "attn", "mlp"])
        m = mods[sub]
        m.train(not m.training)
    elif kind == "fhook":
        sub = rng.choice(["attn", "mlp", ""])
        key = ("fhook", k, sub)
        if key not in side.handles:
            side.handles[key] = mods[sub].register_forward_hook(lambda m, a, o: o * 0.5)
    elif kind == "fhook_rm":
        keys = sorted([kk for kk in side.handles if kk[0] == "fhook"], key=str)
        if keys:
            side.handles.pop(keys[rng.randrange(len(keys))]).remove()
    elif kind == "reassign":
        modname, _, attr = pname.rpartition(".")
        m = mods[modname]
        old = getattr(m, attr)
        with torch.no_grad():
            setattr(m, attr, nn.Parameter(old.detach().clone() * 0.9, requires_grad=old.requires_grad))
    elif kind == "load_sd":
        sd = layer.state_dict()
        sd = {n: v * 0.97 + 0.01 for n, v in sd.items()}
        layer.load_state_dict(sd)
    elif kind == "grad_hook":
        p = dict(layer.named_parameters())[pname]
        key = ("ghook", k, pname)
        if key not in side.handles:
            side.handles[key] = p.register_hook(lambda gr: gr * 2)
    elif kind == "grad_hook_rm":
        keys = sorted([kk for kk in side.handles if kk[0] == "ghook"], key=str)
        if keys:
            side.handles.pop(keys[rng.randrange(len(keys))]).remove()
    elif kind == "post_hook":
        p = dict(layer.named_parameters())[pname]
        key = ("phook", k, pname)
        if key not in side.handles:
            log = side.hook_log
            side.handles[key] = p.register_post_accumulate_grad_hook(
                lambda q, log=log, key=key: log.append((key, None if q.grad is None else q.grad.sum().item()))
            )
    elif kind in ("modify_P", "modify_P_data"):
        P = side.P
        if P is None:
            return
        cap = P.capacity
        t = P.total_tokens
        n = rng.randint(1, min(cap, 6))
        lengths = [rng.randint(1, max(1, t // (2 * n))) for _ in range(n)]
        offs = [0]
        for ln in lengths:
            offs.append(offs[-1] + ln)
        offs += [offs[-1]] * (cap + 1 - len(offs))
        new = torch.tensor(offs, dtype=torch.int32)
        target = P.cu_seqlens_q.data if kind == "modify_P_data" else P.cu_seqlens_q
        target.copy_(new)


def op_sgd(side):
    with torch.no_grad():
        for _, p in side.named_params():
            if p.grad is not None:
                p.sub_(0.01 * p.grad / (p.grad.norm() + 1e-3))


def op_zero(side, set_to_none):
    for m in side.all_modules():
        m.zero_grad(set_to_none=set_to_none)


# ------------------------------------------------------------------------------------------------------ compare
def close(a, b, what):
    if (a is None) != (b is None):
        raise Mismatch(
            f"{what}: None-ness differs: graph {'None' if a is None else 'tensor'}, "
            f"eager {'None' if b is None else 'tensor'}"
        )
    if a is None:
        return
    if a.shape != b.shape:
        raise Mismatch(f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.detach(), b.detach()
    if not torch.allclose(a, b, rtol=1e-7, atol=1e-9, equal_nan=True):
        diff = (a - b).abs()
        raise Mismatch(
            f"{what}: max abs diff {diff.nan_to_num(float('inf')).max().item():.3g}, graph has NaN: "
            f"{bool(a.isnan().any())}, eager has NaN: {bool(b.isnan().any())}"
        )


def compare_grads(g, e, where):
    for (n, p), (_n2, q) in zip(g.named_params(), e.named_params(), strict=True):
        close(p.grad, q.grad, f"{where}: .grad of {n}")


# ------------------------------------------------------------------------------------------------------ run
class Run:
    def __init__(self, cfg, seed, ops):
        self.cfg, self.seed, self.ops = cfg, seed, ops
        self.refusals = []
        self.failures = []
        self.notes = []
        self.notes_kinds = set()
        self.held = []  # (graph tensor, eager tensor, label)

    def hold(self, a, b, label):
        self.held.append((a, b, label))

    def check_held(self, where):
        for a, b, label in self.held:
            close(a, b, f"{where}: held {label}")

    def execute(self, stop_at_first=True):
        cfg = self.cfg
        g, e = build(cfg, self.seed)
        self.g, self.e = g, e
        for i, op in enumerate(self.ops):
            where = f"op {i} {json.dumps(op)}"
            kind = op[0]
            fn = {
                "fwd": lambda s, op=op: op_fwd(s, op[1]),
                "bwd": lambda s, op=op: op_bwd(s, op[1], op[2]),
                "bwd_again": lambda s, op=op: op_bwd_again(s, op[1]),
                "mutate": lambda s, op=op: op_mutate(s, op[1], op[2]),
                "sgd": op_sgd,
                "zero": lambda s, op=op: op_zero(s, op[1]),
                "drop_all": lambda s: s.vals.clear(),
                "check_grads": lambda s: None,
            }[kind]
            gerr = eerr = None
            try:
                fn(g)
            except Exception as exc:  # noqa: BLE001
                gerr = exc
            if gerr is None or kind != "bwd_again":
                try:
                    if gerr is None:
                        fn(e)
                except Exception as exc:  # noqa: BLE001
                    eerr = exc
            if gerr is not None:
                msg = f"{type(gerr).__name__}: {str(gerr).splitlines()[0][:300]}"
                packgraph_like = (
                    isinstance(gerr, PACKGRAPH_ERRORS)
                    or "packgraph" in "".join(traceback.format_exception_only(gerr))
                    or (isinstance(gerr, RuntimeError) and ("graph" in str(gerr).lower() and ":" in str(gerr)[:80]))
                )
                tb = "".join(traceback.format_exception(gerr))
                # does eager run it?
                try:
                    fn(e)
                    eager_ok = True
                except Exception as exc2:  # noqa: BLE001
                    eager_ok = False
                    eerr = exc2
                if not eager_ok:
                    self.notes.append((where, "both raised", msg, f"{type(eerr).__name__}: {eerr}"[:200]))
                elif isinstance(gerr, PACKGRAPH_ERRORS) or (packgraph_like and not _raw_torch_error(gerr)):
                    self.refusals.append((where, msg))
                else:
                    self.failures.append(("unclear-error", where, msg, tb[-3000:]))
                    if stop_at_first:
                        return
                # resync after a refusal (the step may be half done on one side)
                self.resync()
                continue
            if eerr is not None:
                self.failures.append(
                    ("eager-raised-engine-ran", where, f"{type(eerr).__name__}: {str(eerr).splitlines()[0][:300]}", "")
                )
                if stop_at_first:
                    return
                self.resync()
                continue
            try:
                self.after(op, where)
            except Mismatch as m:
                self.failures.append(("mismatch", where, str(m), ""))
                if stop_at_first:
                    return
                self.resync()

    def resync(self):
        g, e = self.g, self.e
        g.vals.clear()
        e.vals.clear()
        self.held.clear()
        op_zero(g, True)
        op_zero(e, True)
        g.hook_log.clear()
        e.hook_log.clear()
        # weights may have diverged? they cannot (sgd only after equal grads); keep.

    def after(self, op, where):
        g, e = self.g, self.e
        kind = op[0]
        if kind == "fwd":
            spec = op[1]
            gv, ev = g.vals[spec["name"]], e.vals[spec["name"]]
            close(gv["out"], ev["out"], f"{where}: output")
            if gv["out"].requires_grad != ev["out"].requires_grad:
                raise Mismatch(
                    f"{where}: output requires_grad graph {gv['out'].requires_grad} eager {ev['out'].requires_grad}"
                )
            if spec["hold"]:
                self.hold(gv["out"], ev["out"], f"output of {spec['name']}")
                self.hold(gv["out"].detach(), ev["out"].detach(), f"detached output of {spec['name']}")
                self.hold(gv["out"][3:7], ev["out"][3:7], f"slice of output of {spec['name']}")
        elif kind in ("bwd", "bwd_again"):
            name = op[1]
            gv, ev = g.vals.get(name), e.vals.get(name)
            if gv is None:
                return
            close(gv["leaf"].grad, ev["leaf"].grad, f"{where}: x.grad")
            res_g, res_e = gv.get("res", []), ev.get("res", [])
            if len(res_g) != len(res_e):
                raise Mismatch(f"{where}: {len(res_g)} returned grads vs {len(res_e)}")
            for j, (a, b) in enumerate(zip(res_g, res_e, strict=False)):
                close(a, b, f"{where}: returned grad {j}")
                if gv["spec"]["hold"] and a is not None:
                    self.hold(a, b, f"returned grad {j} of {name}")
            if len(gv["kept"]) != len(ev["kept"]):
                raise Mismatch(f"{where}: {len(gv['kept'])} hidden-grad hook calls vs {len(ev['kept'])}")
            for j, (a, b) in enumerate(zip(gv["kept"], ev["kept"], strict=False)):
                close(a, b, f"{where}: hook-kept hidden grad {j}")
                self.hold(a, b, f"hook-kept hidden grad {j} of {name}")
            if gv["spec"]["retain_out"]:
                close(gv["h"].grad, ev["h"].grad, f"{where}: retained grad of last hidden")
            compare_grads(g, e, where)
            if gv["spec"]["hold"]:
                for (n, p), (_, q) in zip(g.named_params(), e.named_params(), strict=False):
                    if p.grad is not None or q.grad is not None:
                        self.hold(p.grad, q.grad, f".grad of {n} after {name}")
                if gv["leaf"].grad is not None or ev["leaf"].grad is not None:
                    self.hold(gv["leaf"].grad, ev["leaf"].grad, f"x.grad of {name}")
        elif kind in ("check_grads", "zero", "sgd", "mutate"):
            compare_grads(g, e, where)
            if g.hook_log != e.hook_log and "hook_order" not in self.notes_kinds:
                self.notes_kinds.add("hook_order")
                self.notes.append(
                    (where, "post-accumulate hook order differs", str(g.hook_log[-4:]), str(e.hook_log[-4:]))
                )
            if sorted(map(str, g.hook_log)) != sorted(map(str, e.hook_log)):
                raise Mismatch(f"{where}: post-accumulate hook log differs: {g.hook_log[-3:]} vs {e.hook_log[-3:]}")
            if kind == "sgd":
                for (n, p), (_, q) in zip(g.named_params(), e.named_params(), strict=False):
                    close(p, q, f"{where}: parameter {n}")
        self.check_held(where)


def _raw_torch_error(exc):
    s = str(exc)
    return (
        ("modified by an inplace operation" in s and "packgraph" not in s)
        or "Trying to backward through" in s
        or "does not require grad" in s
    )


def run_seed(seed, nsteps=12, ops=None, cfg=None, stop_at_first=True):
    rng = random.Random(seed)
    c = make_config(rng)
    if cfg:
        c.update(cfg)
    if ops is None:
        ops = gen_program(rng, c, nsteps)
    r = Run(c, seed, ops)
    r.execute(stop_at_first=stop_at_first)
    return r


def main():
    a, b = int(sys.argv[1]), int(sys.argv[2])
    nsteps = 12
    for arg in sys.argv:
        if arg.startswith("--steps="):
            nsteps = int(arg.split("=")[1])
    out = open(
        f"{sys.argv[3] if len(sys.argv) > 3 and not sys.argv[3].startswith('--') else '.'}/results_{a}_{b}.jsonl", "a"
    )
    t0 = time.time()
    for seed in range(a, b):
        try:
            r = run_seed(seed, nsteps, stop_at_first=False)
            rec = {
                "seed": seed,
                "cfg": r.cfg,
                "nops": len(r.ops),
                "failures": r.failures,
                "refusals": r.refusals,
                "notes": r.notes,
            }
        except Exception as exc:  # noqa: BLE001
            rec = {"seed": seed, "crash": "".join(traceback.format_exception(exc))[-3000:]}
        out.write(json.dumps(rec, default=str) + "\n")
        out.flush()
        flag = "FAIL" if rec.get("failures") or rec.get("crash") else "ok"
        print(
            seed,
            flag,
            len(rec.get("refusals", [])),
            (rec.get("failures") or [[None, None, rec.get("crash", "")[-200:]]])[0][:3] if flag == "FAIL" else "",
            f"{time.time() - t0:.0f}s",
            flush=True,
        )


if __name__ == "__main__":
    main()
