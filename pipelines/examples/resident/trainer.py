#!/usr/bin/env python3
"""The resident trainer of pipelines/examples/resident: a small byte-level
decoder-only transformer (model.json; random initialisation from its seed,
nothing downloaded) trained by REINFORCE on generate's rollouts, served to
rlflow's GPU worker through rlflow_trainer (trainer/PROTOCOL.md).

    python3 trainer.py [--config model.json]   # what the pipeline's trainer.command runs
    python3 trainer.py --self-check            # no pipes: build, train 2 steps, print

rlflow_trainer is imported from PYTHONPATH or, failing that, from the
repository's trainer/python (found from this file's place).

Training (one optimizer step per train request, on exactly its rollouts):

* tokens: the UTF-8 bytes of prompt + completion (a chat prompt's messages
  as "role: content" lines); the completion keeps its first
  max_position_embeddings bytes, the prompt its last ones that still fit.
* reward: the rollout's "reward" when it has one, else its "score" (an
  evaluate step's), else the TOY reward: the fraction of the completion's
  bytes that are lowercase ASCII letters. It means nothing; it only gives
  the gradient a direction to show.
* loss = -mean over samples of (reward - baseline) * log p(completion bytes),
  baseline = the batch's mean reward (no state kept between iterations, so a
  replay is exact); gradients accumulated over micro-batches, then clipped,
  then one Adam step.

args (the train step's with.args), all optional: lr (sets Adam's learning
rate from now on), micro_batch (default 16), max_grad_norm (default 1.0; 0
turns clipping off), baseline ("mean" or "none"). An unknown key is refused.

Parameter names are a Llama-style HF model's (model.embed_tokens.weight,
model.layers.N.self_attn.q_proj.weight, ..., model.norm.weight,
lm_head.weight). Embedding lookups and target picks are one-hot products and
attention is written out (no fused kernels), so every op has a deterministic
CUDA implementation: replays are bit for bit.
"""

import os

# cuBLAS reads it when its first handle is made: before torch is imported.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import rlflow_trainer  # noqa: E402
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "trainer", "python"))
    import rlflow_trainer  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

CONFIG_KEYS = {
    "architecture": str, "vocab_size": int, "hidden_size": int, "num_hidden_layers": int,
    "num_attention_heads": int, "intermediate_size": int, "max_position_embeddings": int,
    "rms_norm_eps": float, "rope_theta": float, "tie_word_embeddings": bool, "dtype": str,
    "seed": int, "optimizer": dict,
}
OPTIMIZER_KEYS = {"lr", "betas", "eps", "weight_decay"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ARGS = {"lr", "micro_batch", "max_grad_norm", "baseline"}


def load_config(path):
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError("%s: not a JSON object" % path)
    for k in sorted(set(cfg) - set(CONFIG_KEYS)):
        raise ValueError("%s: unknown key %r" % (path, k))
    for k, typ in CONFIG_KEYS.items():
        if k not in cfg:
            raise ValueError("%s: key %r missing" % (path, k))
        v = cfg[k]
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            cfg[k] = v = float(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ValueError("%s: %r must be %s" % (path, k, typ.__name__))
    if cfg["architecture"] != "rlflow-byte-decoder":
        raise ValueError("%s: architecture %r: this trainer builds rlflow-byte-decoder" % (path, cfg["architecture"]))
    if cfg["vocab_size"] != 256:
        raise ValueError("%s: vocab_size must be 256 (one token per byte)" % path)
    if cfg["dtype"] not in DTYPES:
        raise ValueError("%s: dtype %r, want one of %s" % (path, cfg["dtype"], ", ".join(DTYPES)))
    if cfg["hidden_size"] % cfg["num_attention_heads"] or (cfg["hidden_size"] // cfg["num_attention_heads"]) % 2:
        raise ValueError("%s: hidden_size must split into num_attention_heads heads of an even size" % path)
    for k in sorted(set(cfg["optimizer"]) - OPTIMIZER_KEYS):
        raise ValueError("%s: optimizer: unknown key %r" % (path, k))
    return cfg


# -- the model ------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


def rope(x, theta):
    """Rotary position embedding of x (batch, heads, time, head_dim), computed
    from the positions: no buffer, nothing in the state dict."""
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.theta = cfg["rope_theta"]
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        d = c // self.heads

        def split(y):
            return y.view(b, t, self.heads, d).transpose(1, 2)
        q, k, v = rope(split(self.q_proj(x)), self.theta), rope(split(self.k_proj(x)), self.theta), split(self.v_proj(x))
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(d)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(-1).to(v.dtype)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, ids):
        w = self.embed_tokens.weight
        x = one_hot(ids, w.shape[0], w.dtype) @ w  # a matmul: deterministic backward
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class ByteDecoderForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if cfg["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids):
        return self.lm_head(self.model(ids))


def one_hot(ids, n, dtype):
    """One-hot rows by comparison (elementwise: deterministic on CUDA)."""
    return (ids.unsqueeze(-1) == torch.arange(n, device=ids.device)).to(dtype)


def build(cfg, dev):
    """The model, initialised from cfg's seed (the same on every start)."""
    rlflow_trainer.seed_everything(cfg["seed"])
    model = ByteDecoderForCausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            continue
        nn.init.normal_(p, std=0.02)
    model = model.to(device=dev, dtype=DTYPES[cfg["dtype"]])
    o = cfg["optimizer"]
    opt = torch.optim.Adam(model.parameters(), lr=o.get("lr", 1e-4), betas=tuple(o.get("betas", (0.9, 0.999))),
                           eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.0))
    return model, opt


# -- REINFORCE --------------------------------------------------------------------


def prompt_text(row):
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    msgs = row.get("messages")
    if isinstance(msgs, list):
        return "".join("%s: %s\n" % (m.get("role", ""), m.get("content", "")) for m in msgs if isinstance(m, dict))
    return ""


def toy_reward(text):
    """TOY reward: the fraction of the completion's bytes that are a-z."""
    b = text.encode("utf-8")
    return sum(1 for c in b if 97 <= c <= 122) / len(b) if b else 0.0


def reward_of(row, n):
    for key in ("reward", "score"):
        v = row.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise rlflow_trainer.RequestError("rollout %d: %r is not a finite number" % (n, key))
        return float(v)
    return toy_reward(row.get("text") or "")


def encode(row, max_len):
    """(input bytes, target bytes, completion mask) of one rollout: the
    completion keeps its first max_len bytes, the prompt its last ones that
    fit (at least one byte: a lone newline stands for an empty prompt)."""
    comp = (row.get("text") or "").encode("utf-8")[:max_len]
    room = max_len + 1 - len(comp)
    prompt = prompt_text(row).encode("utf-8")[-room:] or b"\n"
    seq = prompt + comp
    mask = [1 if j + 1 >= len(prompt) else 0 for j in range(len(seq) - 1)]
    return list(seq[:-1]), list(seq[1:]), mask


def make_train_step(cfg):
    max_len = cfg["max_position_embeddings"]

    def train_step(model, opt, batch, args):
        unknown = sorted(set(args) - ARGS)
        if unknown:
            raise rlflow_trainer.RequestError("args: unknown key %r (known: %s)" % (unknown[0], ", ".join(sorted(ARGS))))
        micro = args.get("micro_batch", 16)
        clip = args.get("max_grad_norm", 1.0)
        base_kind = args.get("baseline", "mean")
        if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
            raise rlflow_trainer.RequestError("args: micro_batch must be an integer >= 1")
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
            raise rlflow_trainer.RequestError("args: max_grad_norm must be a number >= 0")
        if base_kind not in ("mean", "none"):
            raise rlflow_trainer.RequestError("args: baseline must be \"mean\" or \"none\"")
        lr = args.get("lr")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0):
            raise rlflow_trainer.RequestError("args: lr must be a number > 0")
        if not batch:
            raise rlflow_trainer.RequestError("the rollouts file holds no rollout")
        rewards = [reward_of(row, n) for n, row in enumerate(batch, 1)]
        samples = [encode(row, max_len) for row in batch]
        # Nothing above touched the model: from here on a failure leaves it
        # in an unknown state (rlflow_trainer then refuses until a load).
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = float(lr)
        dev = next(model.parameters()).device
        baseline = sum(rewards) / len(rewards) if base_kind == "mean" else 0.0
        model.train()
        opt.zero_grad(set_to_none=True)
        total_loss, completion_bytes = 0.0, 0
        for start in range(0, len(samples), micro):
            part = samples[start:start + micro]
            width = max(len(s[0]) for s in part)
            pad = [(s[0] + [0] * (width - len(s[0])), s[1] + [0] * (width - len(s[1])), s[2] + [0] * (width - len(s[2])))
                   for s in part]
            ids = torch.tensor([p[0] for p in pad], device=dev)
            tgt = torch.tensor([p[1] for p in pad], device=dev)
            mask = torch.tensor([p[2] for p in pad], device=dev, dtype=torch.float32)
            adv = torch.tensor([r - baseline for r in rewards[start:start + micro]], device=dev, dtype=torch.float32)
            logp = model(ids).float().log_softmax(-1)
            picked = (logp * one_hot(tgt, logp.shape[-1], logp.dtype)).sum(-1)  # log p(target), deterministic
            seq_logp = (picked * mask).sum(-1)
            loss = -(adv * seq_logp).sum() / len(samples)
            loss.backward()
            total_loss += loss.item()
            completion_bytes += int(mask.sum().item())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {
            "loss": total_loss,
            "reward_mean": sum(rewards) / len(rewards),
            "reward_min": min(rewards),
            "reward_max": max(rewards),
            "baseline": baseline,
            "samples": len(samples),
            "completion_bytes": completion_bytes,
            "grad_norm": float(grad_norm),
        }

    return train_step


def self_check(cfg):
    """Build, list the parameters, train two steps on made-up rollouts."""
    dev = rlflow_trainer.trainer_device()
    rlflow_trainer.enable_determinism(torch)
    model, opt = build(cfg, dev)
    sd = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print("model on %s: %d tensors, %d parameters, %d bytes (%s)" % (dev, len(sd), sum(t.numel() for t in sd.values()), nbytes, cfg["dtype"]))
    for name in list(sd)[:12]:
        print("  %s %s %s" % (name, rlflow_trainer.dtype_name(sd[name].dtype), list(sd[name].shape)))
    print("  ... %s" % list(sd)[-1])
    step = make_train_step(cfg)
    batch = [{"prompt": "Say something: ", "text": t} for t in ("hello there", "HELLO THERE", "12345", "a b c", "", "x" * 400)]
    batch.append({"messages": [{"role": "user", "content": "hi"}], "text": "hey", "score": 1.0})
    for i in (1, 2):
        m = step(model, opt, batch, {"micro_batch": 3})
        print("step %d: %s" % (i, json.dumps(m, sort_keys=True)))
        if not all(math.isfinite(v) for v in m.values()):
            print("FAIL: a metric is not finite")
            return 1
    print("PASS")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "model.json"), help="model and optimizer settings (default: model.json beside this file)")
    ap.add_argument("--self-check", action="store_true", help="no pipes: build the model, train two steps on made-up rollouts, print")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.self_check:
        return self_check(cfg)
    dev = rlflow_trainer.trainer_device()
    model, opt = build(cfg, dev)
    rlflow_trainer.serve(model, opt, make_train_step(cfg), seed=cfg["seed"], device=dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
