"""Hand mutants of the Gemma slice (issue 46): each applied alone, then
tests/models/test_gemma_parity.py run (`--parity-only` leaves out the config test). 2026-12-07:
17 of 17 killed, the three the config test caught first (10, 13, 14) killed by parity alone too.

    python docs/history/gemma_mutants.py [index ...] [--parity-only]
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
L = "jaxserve/models/llama.py"
M = [
    (
        "(1+w) -> w",
        L,
        "(normed * (1.0 + scale.astype(jnp.float32)))",
        "(normed * scale.astype(jnp.float32))",
    ),
    ("no embedding scale", L, "h = h * jnp.asarray(math.sqrt(c.hidden_size), self.dtype)", "h = h"),
    (
        "no attention soft cap (xla path)",
        "pallas_kernels/ragged_paged_attention/xla_blocked.py",
        "return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)",
        "return scores",
    ),
    ("no final soft cap", L, "out = cap * jnp.tanh(out / cap)", "out = out"),
    (
        "one window for every layer",
        L,
        "window = c.layer_window(self.layer_index)",
        "window = c.sliding_window",
    ),
    (
        "layer 0's RoPE for every layer",
        L,
        "*trig[self.config.layer_rope(i)])",
        "*trig[self.config.layer_rope()])",
    ),
    (
        "pre/post feed-forward norms swapped",
        L,
        'norm("pre_feedforward_layernorm" if gemma',
        'norm("post_feedforward_layernorm" if gemma',
    ),
    (
        "post-attention norm after the residual",
        L,
        'if gemma:\n            attn_out = norm("post_attention_layernorm")(attn_out)\n        h = h + attn_out',  # noqa: E501
        'h = h + attn_out\n        if gemma:\n            h = norm("post_attention_layernorm")(h)',
    ),
    (
        "post-feedforward norm dropped into residual",
        L,
        'if gemma:\n            out = norm("post_feedforward_layernorm")(out)\n        return (h + out,',  # noqa: E501
        'if gemma:\n            h = norm("post_feedforward_layernorm")(h)\n        return (h + out,',  # noqa: E501
    ),
    (
        "exact gelu for tanh gelu",
        L,
        "jax.nn.gelu(gate, approximate=True)",
        "jax.nn.gelu(gate, approximate=False)",
    ),
    (
        "head_dim**-0.5 for query_pre_attn_scalar",
        "jaxserve/models/config.py",
        "return (self.query_pre_attn_scalar or self.head_dim) ** -0.5",
        "return self.head_dim**-0.5",
    ),
    (
        "q/k norms without (1 + w)",
        L,
        'RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms, name="q_norm")',
        'RMSNorm(c.rms_norm_eps, self.dtype, False, name="q_norm")',
    ),
    (
        "fused C++ call for capped layers",
        L,
        "fusable = c.attn_logit_softcap is None",
        "fusable = True",
    ),
    (
        "local RoPE lost in the parser",
        "checkpoints/hf_config.py",
        'local = _rope_config(hf, params.get("sliding_attention") or {"rope_theta": 10000.0})',
        "local = None",
    ),
    (
        "window one wider",
        "jaxserve/models/config.py",
        "return self.sliding_window if self._is_local(layer) else None",
        "return self.sliding_window + 1 if self._is_local(layer) else None",
    ),
    (
        "final norm without (1 + w)",
        L,
        "self.norm = RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms)",
        "self.norm = RMSNorm(c.rms_norm_eps, self.dtype)",
    ),
    (
        "soft cap before scaling (reference)",
        "pallas_kernels/ragged_paged_attention/reference.py",
        "scores = soft_cap * jnp.tanh(scores / soft_cap)",
        "scores = soft_cap * jnp.tanh(scores / sm_scale / soft_cap) * sm_scale",
    ),
]
only = {a for a in sys.argv[1:] if not a.startswith("-")}
EXTRA = ["-k", "not config_switches"] if "--parity-only" in sys.argv else []
results = []
for i, (name, rel, old, new) in enumerate(M):
    if only and str(i) not in only:
        continue
    path = ROOT / rel
    text = path.read_text()
    assert text.count(old) == 1, (name, text.count(old))
    path.write_text(text.replace(old, new))
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/models/test_gemma_parity.py",
                *EXTRA,
            ],
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": "/tmp"},
            capture_output=True,
            text=True,
            timeout=900,
        )
        killed = r.returncode != 0
        first = next(
            (x for x in r.stdout.splitlines() if x.startswith(("FAILED", "ERROR"))),
            "",
        )
    finally:
        path.write_text(text)
    results.append((name, killed, first))
    print(f"{i:2d} {'KILLED ' if killed else 'SURVIVED'} {name}: {first[:150]}", flush=True)
print(f"killed {sum(k for _, k, _ in results)} of {len(results)}")
