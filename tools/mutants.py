"""Plant plausible one-line bugs, one at a time, in a scratch copy of ``src/``, and check that the fast suite
(``pytest -m "not multirank"``, what ``make test-fast`` runs) fails for each. Not collected by pytest (it takes
a while): run it by hand from the repository root (docs/testing.md),

    python tools/mutants.py                 # every mutant
    python tools/mutants.py NAME ...        # the named ones
    python tools/mutants.py --check         # only check that every mutant's original text is still in src/
    python tools/mutants.py --list          # the mutants' names

Each mutant is (name, file under src/torchtsp, exact original text, replacement, test files likely to catch it).
The original text must occur exactly once in its file. A mutant is first run against its likely catchers
(``pytest -x -m "not multirank"`` on those files: seconds), and only if they all pass against the whole fast
suite (minutes): a fast run when the catcher is right, the whole suite's verdict otherwise.

It prints one line per mutant: the first failing test, or SURVIVED. Exit status 1 if any survived or if a
mutant's original text is no longer found (the code moved: update the entry).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, file under src/torchtsp, exact original text, replacement, likely catchers under tests/)
MUTANTS = [
    # ---------------------------------------------------------------- de582d6's 31, on today's source
    ('rope-sign', 'layers.py',
     'torch.mul(x1, cos[..., :half], out=out1).sub_(',
     'torch.mul(x1, cos[..., :half], out=out1).add_(',
     ['test_hf.py']),
    ('rope-sign-autograd', 'layers.py',
     'torch.cat([x1 * cos[..., :half] - x2',
     'torch.cat([x1 * cos[..., :half] + x2',
     ['test_hf.py']),
    ('rope-offset', 'rope.py',
     'angles = positions.float()[..., None] * inv_freq',
     'angles = (positions.float() + 1)[..., None] * inv_freq',
     ['test_families.py', 'test_hf.py']),
    ('rope-freq', 'rope.py',
     'dtype=torch.int64, device=device).float() / head_dim))',
     'dtype=torch.int64, device=device).float() / (head_dim - 2)))',
     ['test_hf.py']),
    ('rmsnorm-eps-outside', 'layers.py',
     'torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)',
     '(torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)) + eps)',
     ['test_hf.py']),
    ('rmsnorm-mean-abs', 'layers.py',
     'x32.pow(2).mean(-1, keepdim=True)',
     'x32.abs().mean(-1, keepdim=True) ** 2',
     ['test_hf.py']),
    ('gqa-grouping-fused', 'kernels.py',
     '_flash_forward(q[:, i::g], k, v, causal)',
     '_flash_forward(q[:, i * k.shape[1]:(i + 1) * k.shape[1]], k, v, causal)',
     ['test_attention.py']),
    ('gqa-grouping-cache', 'kernels.py',
     'qf = q.float().reshape(B, Hkv, g * T, d)',
     'qf = q.float().view(B, g, Hkv, T, d).transpose(1, 2).reshape(B, Hkv, g * T, d)',
     ['test_core_math.py']),
    ('causal-off-by-one-cache', 'kernels.py',
     'hidden = k_pos[:, None, None, None, a:b] > q_pos',
     'hidden = k_pos[:, None, None, None, a:b] >= q_pos',
     ['test_core_math.py']),
    ('causal-off-by-one-portable', 'kernels.py',
     's = s.masked_fill(torch.arange(a, b, device=q.device)[None, :] > rows',
     's = s.masked_fill(torch.arange(a, b, device=q.device)[None, :] >= rows',
     ['test_attention.py']),
    ('softmax-scale-cache', 'kernels.py',
     'qf = q.float().reshape(B, Hkv, g * T, d) * d**-0.5',
     'qf = q.float().reshape(B, Hkv, g * T, d) / d',
     ['test_core_math.py']),
    ('softmax-scale-portable', 'kernels.py',
     's = (q.float() @ k[..., a:b, :].float().transpose(-1, -2)) * q.shape[-1] ** -0.5',
     's = (q.float() @ k[..., a:b, :].float().transpose(-1, -2)) / q.shape[-1]',
     ['test_attention.py']),
    ('swiglu-gate-up-swap', 'layers.py',  # was `F.silu(gate) * up` in swiglu; now layers.gated
     'return activation(gate, kind) * up',
     'return activation(up, kind) * gate',
     ['test_hf.py']),
    ('lse-merge-max', 'distributed/attention.py',
     'lse = torch.logaddexp(self.lse, part_lse)',
     'lse = torch.maximum(self.lse, part_lse)',
     ['test_attention.py']),
    ('lse-merge-weight', 'distributed/attention.py',
     'self.acc.addcmul_(part, torch.exp(part_lse - shift)',
     'self.acc.addcmul_(part, torch.exp(self.lse - shift)',
     ['test_attention.py']),
    ('loss-count-ignored', 'model.py',
     'return LossTerms(nll_sum, (labels != IGNORE_INDEX).sum()',
     'return LossTerms(nll_sum, (labels != -1).sum()',
     ['test_core_math.py']),
    ('loss-ignore-index', 'model.py',
     'loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)',
     'loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp_min(0))',
     ['test_hf.py']),
    ('adamw-betas-swapped', 'train/optim.py',
     'betas=(0.9, 0.95)',
     'betas=(0.95, 0.9)',
     ['test_core_math.py']),
    ('adamw-decay-on-norms', 'train/optim.py',
     '(no_decay if all(is_norm_weight(n) for n in names) else decay)',
     '(decay if all(is_norm_weight(n) for n in names) else no_decay)',
     ['test_core_math.py']),
    ('lr-warmup-from-zero', 'train/optim.py',
     'return (step + 1) / warmup',
     'return step / warmup',
     ['test_core_math.py']),
    ('lr-cosine-no-floor', 'train/optim.py',
     'return min_ratio + (1 - min_ratio) * 0.5',
     'return 0.5',
     ['test_core_math.py']),
    ('temperature-inverted', 'infer/sampling.py',
     'return self.argmax_over_slices(logits / self.temperature + own)',
     'return self.argmax_over_slices(logits * self.temperature + own)',
     ['test_sampling.py']),
    ('temperature-inverted-filtered', 'infer/sampling.py',
     'full = filter_logits(self.gather_full(logits) / self.temperature',
     'full = filter_logits(self.gather_full(logits) * self.temperature',
     ['test_sampling.py']),
    ('top-p-drops-crossing-token', 'infer/sampling.py',
     'drop = mass_before >= top_p',
     'drop = probs.cumsum(dim=-1) >= top_p',
     ['test_infer.py', 'test_sampling.py']),
    ('top-k-off-by-one', 'infer/sampling.py',
     'kth = logits.topk(top_k, dim=-1).values[:, -1:]',
     'kth = logits.topk(top_k, dim=-1).values[:, -2:-1]',
     ['test_infer.py', 'test_sampling.py']),
    ('zigzag-chunk-order', 'chunks.py',  # chunk_ids moved from distributed/zigzag.py
     'return rank, 2 * world - 1 - rank',
     'return rank, world + rank',
     ['test_shard_math.py', 'test_attention.py']),
    ('router-no-renormalise', 'layers.py',
     'top = top / top.sum(dim=-1, keepdim=True)',
     'top = top',
     ['test_documents.py', 'test_moe.py']),
    # The scheduler moved from serve/worker.py's grouped admission to serve/paged_scheduler.py: the same four
    # kinds of bug on today's code (order, a queued cancel, the fit rule, a request that can never fit).
    ('scheduler-lifo', 'serve/paged_scheduler.py',
     'self.waiting.append(seq)',
     'self.waiting.appendleft(seq)',
     ['test_blocks.py', 'test_serve_scheduler.py']),
    ('scheduler-keeps-cancelled-queued', 'serve/paged_scheduler.py',
     'elif seq in self.waiting:\n            self.waiting.remove(seq)',
     'elif seq in self.waiting:\n            pass',
     ['test_blocks.py', 'test_serve_scheduler.py']),
    ('scheduler-fit-forgets-max-tokens', 'serve/paged_scheduler.py',
     'need = len(prompt) + max(max_tokens, 1) - 1',
     'need = len(prompt)',
     ['test_blocks.py', 'test_serve_scheduler.py']),
    ('scheduler-preempts-oldest', 'serve/paged_scheduler.py',
     'victim = self.running[-1]',
     'victim = self.running[0]',
     ['test_blocks.py', 'test_serve_paged.py']),
    # ---------------------------------------------------------------- issue 48's three named bugs
    ('logprobs-lse-no-rescale', 'infer/logprobs.py',
     'lse = high_shift + torch.log((totals * torch.exp(peaks - high_shift)).sum(dim=0))',
     'lse = high_shift + torch.log(totals.sum(dim=0))',
     ['test_shard_math.py', 'test_logprobs.py']),
    ('grouped-head-j-mod-c', 'kv_layouts.py',
     'first = rank // max(ranks // n_kv, 1) * per_rank',
     'first = rank % max(ranks // n_kv, 1) * per_rank',
     ['test_kv_placement.py', 'test_shard_math.py']),
    ('zero-overwrites-micro-batches', 'train/zero.py',
     'return part if owned is None else owned.add_(part)',
     'return part',
     ['test_shard_math.py']),
    # ---------------------------------------------------------------- one per pure function of issue 48 item 1
    ('logprobs-topn-merge-drops-ranks', 'infer/logprobs.py',
     'cand_values = every[:, 3:3 + top_n].permute(2, 0, 1).reshape(rows, -1)',
     'cand_values = every[:1, 3:3 + top_n].permute(2, 0, 1).reshape(rows, -1)',
     ['test_shard_math.py']),
    ('logprobs-target-offset', 'infer/logprobs.py',
     'local = targets - vocab_start',
     'local = targets',
     ['test_shard_math.py']),
    ('zigzag-unshard-second-chunk', 'distributed/zigzag.py',
     'chunks.select(dim, 2 * world - 1 - rank).copy_(halves[rank].select(dim, 1))',
     'chunks.select(dim, world + rank).copy_(halves[rank].select(dim, 1))',
     ['test_shard_math.py']),
    ('zigzag-positions-chunk', 'distributed/zigzag.py',
     'chunk = seq_len // (2 * world)',
     'chunk = seq_len // world',
     ['test_shard_math.py']),
    ('window-off-by-one', 'chunks.py',
     'lo = max(0, c * chunk - window + 1)',
     'lo = max(0, c * chunk - window)',
     ['test_shard_math.py', 'test_window.py']),
    ('window-needs-sum-not-max', 'chunks.py',
     'need[piece.owner][piece.half] = max(need[piece.owner][piece.half], piece.length)',
     'need[piece.owner][piece.half] += piece.length',
     ['test_shard_math.py', 'test_window.py']),
    ('heads-layout-per-rank', 'kv_layouts.py',
     'per_rank = max(n_kv // ranks, 1)',
     'per_rank = max(ranks // n_kv, 1)',
     ['test_kv_placement.py', 'test_shard_math.py']),
    ('kv-placement-offset', 'kv_layouts.py',
     'return pos % self.block_tokens // self.token_ranks',
     'return pos % self.block_size',
     ['test_kv_placement.py', 'test_shard_math.py']),
    ('zero-chunk-floor', 'train/zero.py',
     'return -(-rows // dp) * per_row',
     'return max(rows // dp, 1) * per_row',
     ['test_shard_math.py', 'test_grad_norm.py']),
    ('zero-padding-row', 'train/zero.py',
     'rows[len(full), :rest.numel()].copy_(rest)',
     'rows[len(full) - 1, :rest.numel()].copy_(rest)',
     ['test_shard_math.py']),
    ('zero-bucket-offset', 'train/zero.py',
     'part = total[slot.offset:slot.offset + slot.hi - slot.lo]',
     'part = total[:slot.hi - slot.lo]',
     ['test_zero.py', 'test_grad_norm.py']),
    ('grad-norm-kv-copies-counted-twice', 'train/optim.py',
     'weight *= dim[1] / sizes[axis]',
     'weight *= 1 / sizes[axis]',
     ['test_grad_norm.py']),
    ('document-block-boundary', 'masks.py',
     'ka = max(u, k_start) if window is None else max(u, k_start, ta - window + 1)',
     'ka = max(u - 1, k_start) if window is None else max(u, k_start, ta - window + 1)',
     ['test_shard_math.py', 'test_documents.py']),
    ('window-block-edge-off-by-one', 'masks.py',
     'lo = None if window is None else shift - (window - 1)',
     'lo = None if window is None else shift - window',
     ['test_shard_math.py', 'test_window.py']),
    ('partial-merge-max-not-lse', 'infer/cache.py',
     'total = with_sink(torch.logsumexp(parts[..., d], dim=0), sinks)',
     'total = with_sink(parts[..., d].amax(dim=0), sinks)',
     ['test_shard_math.py']),
    ('paged-blocks-for-floor', 'serve/blocks.py',
     'return math.ceil(n_tokens / self.block_tokens)',
     'return n_tokens // self.block_tokens',
     ['test_blocks.py', 'test_kv_placement.py']),
    # ---------------------------------------------------------------- issue 60: Gated DeltaNet's math core
    ('delta-q-unscaled', 'delta_rule.py',
     'return (l2norm(q) if l2 else q) * q.shape[-1] ** -0.5',
     'return l2norm(q) if l2 else q',
     ['test_delta_rule.py']),
    ('delta-doc-start-keeps-incoming-state', 'delta_rule.py',
     'cum = cum.masked_fill(segment != 0, float("-inf"))',
     'cum = cum.masked_fill(segment < 0, float("-inf"))',
     ['test_delta_rule.py']),
    ('delta-doc-start-keeps-earlier-writes', 'delta_rule.py',
     'to_end = to_end.masked_fill(segment != segment[..., -1:], float("-inf"))',
     'to_end = to_end.masked_fill(segment < 0, float("-inf"))',
     ['test_delta_rule.py']),
    ('delta-doc-pairs-unmasked', 'delta_rule.py',
     'pair_kept = lower & (segment.unsqueeze(-1) == segment.unsqueeze(-2))',
     'pair_kept = lower',
     ['test_delta_rule.py']),
    ('delta-compose-order', 'delta_rule.py',
     'return Summary(then.A @ first.A, then.A @ first.B + then.B)',
     'return Summary(first.A @ then.A, then.A @ first.B + then.B)',
     ['test_delta_rule.py']),
    ('delta-adjoint-untransposed', 'delta_rule.py',
     'adjoint = local + transition.transpose(-1, -2) @ adjoint',
     'adjoint = local + transition @ adjoint',
     ['test_delta_rule.py']),
    ('delta-summary-grad-transposed', 'delta_rule.py',
     'return [Summary(after @ state.transpose(-1, -2), after)',
     'return [Summary(state @ after.transpose(-1, -2), after)',
     ['test_delta_rule.py']),
    ('delta-step-without-beta', 'delta_rule.py',
     'correction = beta.unsqueeze(-1) * (v - (k.unsqueeze(-2) @ state).squeeze(-2))',
     'correction = v - (k.unsqueeze(-2) @ state).squeeze(-2)',
     ['test_delta_rule.py']),
    ('conv-halo-one-short', 'delta_rule.py',
     'return tuple(pieces[:-1] for pieces in window_keys(seq_len, world, rank, kernel_size))',
     'return tuple(pieces[:-1] for pieces in window_keys(seq_len, world, rank, kernel_size - 1))',
     ['test_delta_rule.py']),
    ('conv-reads-one-across-a-start', 'delta_rule.py',
     'window = window.masked_fill((doc_positions < kernel - 1 - j).unsqueeze(-1), 0)',
     'window = window.masked_fill((doc_positions < kernel - 2 - j).unsqueeze(-1), 0)',
     ['test_delta_rule.py']),
    ('conv-window-keeps-one-across-a-start', 'delta_rule.py',
     'window = window.masked_fill((lag > doc_positions[:, -1:]).unsqueeze(-1), 0)',
     'window = window.masked_fill((lag > doc_positions[:, -1:] + 1).unsqueeze(-1), 0)',
     ['test_delta_rule.py']),
    ('halo-grad-parts-front', 'delta_rule.py',
     'return list(d_halo[:, d_halo.shape[1] - total:].split(list(lengths), dim=1))',
     'return list(d_halo[:, :total].split(list(lengths), dim=1))',
     ['test_delta_rule.py']),
    # ---------------------------------------------------------------- the step plan's codec, declared once (issue 58)
    ('plan-header-field-wrong-codec', 'serve/plan.py',
     'values = {f.path: f.codec.get(head) for f in HEADER_FIELDS}',
     'values = {f.path: INT.get(head) for f in HEADER_FIELDS}',
     ['test_serve_plan.py']),
    ('plan-optional-lenient-flag', 'serve/plan.py',
     'lambda r: c.get(r) if _flag(r) else None',
     'lambda r: c.get(r) if r.one() else None',
     ['test_serve_plan.py']),
    ('plan-text-padding-unchecked', 'serve/plan.py',
     'if any(data[n:]):',
     'if False:',
     ['test_serve_plan.py']),
    ('plan-dict-repeated-key', 'serve/plan.py',
     'if len(d) != n:',
     'if len(d) > n:',
     ['test_serve_plan.py']),
    ('plan-tables-for-any-request', 'serve/plan.py',
     'if sorted(tables) != sorted(_work(plan)):',
     'if not set(_work(plan)) <= set(tables):',
     ['test_serve_plan.py']),
    ('plan-empty-prefill-chunk', 'serve/plan.py',
     'if first < 0 or n < 1), None)',
     'if first < 0 or n < 0), None)',
     ['test_serve_plan.py']),
    ('plan-admission-count-unchecked', 'serve/plan.py',
     'if r.at - start != n:',
     'if r.at - start > n:',
     ['test_serve_plan.py']),
    ('vocab-encoding-metaspace-always-only', 'data/tokenizers.py',
     'pre.get("prepend_scheme") in ("always", "first")',
     'pre.get("prepend_scheme") == "always"',
     ['test_serve_sampling.py']),
    ('vocab-encoding-last-byte-decoder', 'data/tokenizers.py',
     'kind = next((t for t in decoders if',
     'kind = next((t for t in reversed(decoders) if',
     ['test_serve_sampling.py']),
    ('vocab-encoding-any-prepend', 'data/tokenizers.py',
     'n["type"] == "Prepend" and n.get("prepend") == "\\u2581"',
     'n["type"] == "Prepend"',
     ['test_serve_sampling.py']),
]

PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not multirank", "-p", "no:cacheprovider"]


def plant(scratch: Path, file: str, old: str, new: str) -> bool:
    path = scratch / "src" / "torchtsp" / file
    text = path.read_text()
    if text.count(old) != 1:
        return False
    path.write_text(text.replace(old, new))
    return True


def found(file: str, old: str) -> bool:
    path = ROOT / "src" / "torchtsp" / file
    return path.exists() and path.read_text().count(old) == 1


def first_failure(paths: list[str], env: dict) -> str | None:
    """The first test that fails on ``paths`` (None: all passed)."""
    out = subprocess.run([*PYTEST, *paths], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode == 0:
        return None
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)
    if failed:
        return failed[0]
    return f"pytest exit {out.returncode}: {out.stdout.strip().splitlines()[-1:]}"


def run(name: str, file: str, old: str, new: str, catchers: list[str]) -> str:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        scratch = Path(tmp)
        shutil.copytree(ROOT / "src", scratch / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        if not plant(scratch, file, old, new):
            return "NOT FOUND (the source changed: update this entry)"
        env = {**os.environ, "PYTHONPATH": f"{scratch / 'src'}{os.pathsep}{ROOT / 'tests'}",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        first = [f"tests/{f}" for f in catchers if (ROOT / "tests" / f).exists()]
        verdict = first_failure(first, env) if first else None
        if verdict is None:  # the likely catchers missed it: the whole fast suite decides
            verdict = first_failure(["tests"], env)
        return verdict or "SURVIVED"


def main(argv: list[str]) -> int:
    if "--list" in argv:
        print("\n".join(m[0] for m in MUTANTS))
        return 0
    names = [a for a in argv if not a.startswith("--")]
    unknown = set(names) - {m[0] for m in MUTANTS}
    if unknown:
        print(f"unknown mutants: {', '.join(sorted(unknown))} (python tools/mutants.py --list)", file=sys.stderr)
        return 2
    by_name = {m[0]: m for m in MUTANTS}
    chosen = [by_name[n] for n in dict.fromkeys(names)] if names else MUTANTS  # in the order given
    if "--check" in argv:
        missing = [m[0] for m in chosen if not found(m[1], m[2])]
        for name in missing:
            print(f"{name:36} NOT FOUND (the source changed: update this entry)")
        return 1 if missing else 0
    bad = 0
    for name, file, old, new, catchers in chosen:
        start = time.monotonic()
        verdict = run(name, file, old, new, catchers)
        bad += verdict.startswith(("SURVIVED", "NOT FOUND"))
        print(f"{name:36} {verdict}  ({time.monotonic() - start:.0f} s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
