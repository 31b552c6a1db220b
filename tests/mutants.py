"""Plant plausible one-line bugs in core math, one at a time, in a scratch copy of the package, and check that a
fast (single-process) test fails for each. Not a pytest module (it takes minutes): run it by hand,

    python tests/mutants.py [NAME ...]        # every mutant, or the named ones

It prints one line per mutant: the test that failed first, or SURVIVED. Exit status 1 if any survived or if a
mutant's line is no longer in the source (the code moved: update the entry).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = ["tests/test_attention.py", "tests/test_hf.py", "tests/test_families.py", "tests/test_documents.py",
        "tests/test_moe.py", "tests/test_infer.py", "tests/test_sampling.py", "tests/test_zero.py",
        "tests/test_tsp_step.py", "tests/test_core_math.py", "tests/test_serve_scheduler.py"]

# (name, file under src/torchtsp, exact text, replacement). Each text must occur exactly once.
MUTANTS = [
    ('rope-sign', 'layers.py',
     'torch.mul(x1, cos[..., :half], out=out1).sub_(',
     'torch.mul(x1, cos[..., :half], out=out1).add_('),
    ('rope-sign-autograd', 'layers.py',
     'torch.cat([x1 * cos[..., :half] - x2',
     'torch.cat([x1 * cos[..., :half] + x2'),
    ('rope-offset', 'layers.py',
     'angles = positions.float()[..., None] * inv_freq',
     'angles = (positions.float() + 1)[..., None] * inv_freq'),
    ('rope-freq', 'layers.py',
     'dtype=torch.float32, device=device) / head_dim))',
     'dtype=torch.float32, device=device) / (head_dim - 2)))'),
    ('rmsnorm-eps-outside', 'layers.py',
     'torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)',
     '(torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)) + eps)'),
    ('rmsnorm-mean-abs', 'layers.py',
     'x32.pow(2).mean(-1, keepdim=True)',
     'x32.abs().mean(-1, keepdim=True) ** 2'),
    ('gqa-grouping-fused', 'kernels.py',
     '_flash_forward(q[:, i::g], k, v, causal)',
     '_flash_forward(q[:, i * k.shape[1]:(i + 1) * k.shape[1]], k, v, causal)'),
    ('gqa-grouping-cache', 'kernels.py',
     'qf = q.float().reshape(B, Hkv, g * T, d)',
     'qf = q.float().view(B, g, Hkv, T, d).transpose(1, 2).reshape(B, Hkv, g * T, d)'),
    ('causal-off-by-one-cache', 'kernels.py',
     'hidden = k_pos[:, None, None, None, a:b] > q_pos',
     'hidden = k_pos[:, None, None, None, a:b] >= q_pos'),
    ('causal-off-by-one-portable', 'kernels.py',
     's = s.masked_fill(torch.arange(a, b, device=q.device)[None, :] > rows',
     's = s.masked_fill(torch.arange(a, b, device=q.device)[None, :] >= rows'),
    ('softmax-scale-cache', 'kernels.py',
     'qf = q.float().reshape(B, Hkv, g * T, d) * d**-0.5',
     'qf = q.float().reshape(B, Hkv, g * T, d) / d'),
    ('softmax-scale-portable', 'kernels.py',
     '.transpose(-1, -2)) * q.shape[-1] ** -0.5',
     '.transpose(-1, -2)) / q.shape[-1]'),
    ('swiglu-gate-up-swap', 'layers.py',
     'return F.silu(gate) * up',
     'return F.silu(up) * gate'),
    ('lse-merge-max', 'distributed/attention.py',
     'lse = torch.logaddexp(self.lse, part_lse)',
     'lse = torch.maximum(self.lse, part_lse)'),
    ('lse-merge-weight', 'distributed/attention.py',
     'self.acc.addcmul_(part, torch.exp(part_lse - shift)',
     'self.acc.addcmul_(part, torch.exp(self.lse - shift)'),
    ('loss-count-ignored', 'model.py',
     'return LossTerms(nll_sum, (labels != IGNORE_INDEX).sum()',
     'return LossTerms(nll_sum, (labels != -1).sum()'),
    ('loss-ignore-index', 'model.py',
     'loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)',
     'loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp_min(0))'),
    ('adamw-betas-swapped', 'train/optim.py',
     'betas=(0.9, 0.95)',
     'betas=(0.95, 0.9)'),
    ('adamw-decay-on-norms', 'train/optim.py',
     '(no_decay if all(is_norm_weight(n) for n in names) else decay)',
     '(decay if all(is_norm_weight(n) for n in names) else no_decay)'),
    ('lr-warmup-from-zero', 'train/optim.py',
     'return (step + 1) / warmup',
     'return step / warmup'),
    ('lr-cosine-no-floor', 'train/optim.py',
     'return min_ratio + (1 - min_ratio) * 0.5',
     'return 0.5'),
    ('temperature-inverted', 'infer/sampling.py',
     'return self.argmax_over_slices(logits / self.temperature + own)',
     'return self.argmax_over_slices(logits * self.temperature + own)'),
    ('temperature-inverted-filtered', 'infer/sampling.py',
     'full = filter_logits(self.gather_full(logits) / self.temperature',
     'full = filter_logits(self.gather_full(logits) * self.temperature'),
    ('top-p-drops-crossing-token', 'infer/sampling.py',
     'drop = mass_before >= top_p',
     'drop = probs.cumsum(dim=-1) >= top_p'),
    ('top-k-off-by-one', 'infer/sampling.py',
     'kth = logits.topk(top_k, dim=-1).values[:, -1:]',
     'kth = logits.topk(top_k, dim=-1).values[:, -2:-1]'),
    ('zigzag-chunk-order', 'distributed/zigzag.py',
     'return rank, 2 * world - 1 - rank',
     'return rank, world + rank'),
    ('router-no-renormalise', 'layers.py',
     'top = top / top.sum(dim=-1, keepdim=True)',
     'top = top'),
    ('scheduler-lifo', 'serve/worker.py',
     'admit.append(self.waiting.popleft())',
     'admit.append(self.waiting.pop())'),
    ('scheduler-keeps-cancelled-queued', 'serve/worker.py',
     'self.dropped.append((a.request_id, "cancelled"))',
     'pass'),
    ('scheduler-unpadded-fit', 'serve/worker.py',
     'if any(row_slots(runner.token_multiple, padded, a.max_tokens) > runner.capacity for a in group):',
     'if any(row_slots(runner.token_multiple, len(a.prompt), a.max_tokens) > runner.capacity for a in group):'),
    ('scheduler-too-long-blocks', 'serve/worker.py',
     '"too_long"))\n                    continue',
     '"too_long"))\n                    break'),
]


def plant(scratch: Path, file: str, old: str, new: str) -> bool:
    path = scratch / "src" / "torchtsp" / file
    text = path.read_text()
    if text.count(old) != 1:
        return False
    path.write_text(text.replace(old, new))
    return True


def run(name: str, file: str, old: str, new: str) -> str:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        scratch = Path(tmp)
        shutil.copytree(ROOT / "src", scratch / "src", ignore=shutil.ignore_patterns("__pycache__"))
        if not plant(scratch, file, old, new):
            return "NOT FOUND (the source changed: update this entry)"
        env = {**os.environ, "PYTHONPATH": f"{scratch / 'src'}{os.pathsep}{ROOT / 'tests'}"}
        files = [f for f in FAST if (ROOT / f).exists()]
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not multirank",
                              "-p", "no:cacheprovider", *files],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)
        if out.returncode == 0:
            return "SURVIVED"
        return failed[0] if failed else f"pytest exit {out.returncode}: {out.stdout.strip().splitlines()[-1:]}"


def main(names: list[str]) -> int:
    bad = 0
    for name, file, old, new in MUTANTS:
        if names and name not in names:
            continue
        verdict = run(name, file, old, new)
        bad += verdict.startswith(("SURVIVED", "NOT FOUND"))
        print(f"{name:32} {verdict}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
