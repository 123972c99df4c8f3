"""Sparse workloads for the benchmarks: synthetic (uniform, Zipf) and real (embedding gradients of stdlib text).

Everything is deterministic given (seed, rank, ...): each call builds its own torch.Generator from a hash of its
arguments, so results do not depend on call order or on the global RNG.

    uniform(numel, density, rank, seed)            k = round(density * numel) non-zeros, positions uniform
    zipf(numel, density, rank, seed, alpha=1.1)    k non-zeros, positions Zipf-skewed (small indices hot)
    StdlibCorpus(vocab_size=None)                   the Python standard library's source as a token stream
    embedding_gradient(corpus, dim, batch_tokens, rank, step, seed)
                                                    the gradient of an embedding table for one rank's batch
    union_growth(index_sets, ks)                    gamma(k) = |union of k ranks' non-zeros| / mean |one rank's|
    contiguous_imbalance(indices, numel, parts)     max/mean load of [0, numel) cut into equal contiguous ranges

`python benchmarks/workloads.py` prints the statistics of the real-text workload (vocabulary, density,
gamma, contiguous imbalance).
"""

import collections
import fcntl
import hashlib
import math
import os
import re
import sys
import sysconfig
import time

import torch

# ----------------------------------------------------------------------------------------------------------
# seeding


def make_generator(seed, *keys):
    """A CPU generator seeded from (seed, *keys) through SHA-256: stable across runs, processes and Python
    versions (unlike hash()), and unrelated streams for neighbouring ranks or steps."""
    digest = hashlib.sha256(repr((int(seed),) + tuple(keys)).encode()).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def _count(numel, density):
    if numel < 0 or not 0.0 <= density <= 1.0:
        raise ValueError(f"need numel >= 0 and 0 <= density <= 1, got {numel}, {density}")
    return min(numel, int(round(density * numel)))


def _nonzero_normal(k, gen, dtype):
    """k values ~ N(0, 1) in dtype, none exactly zero (a zero would silently lower the density; in fp16 a
    value below 6e-8 rounds to 0)."""
    v = torch.randn(k, generator=gen).to(dtype)
    v[v == 0] = 1
    return v


def _scatter(numel, positions, values):
    out = torch.zeros(numel, dtype=values.dtype)
    out[positions] = values
    return out


# ----------------------------------------------------------------------------------------------------------
# synthetic workloads


def uniform(numel, density, rank=0, seed=0, dtype=torch.float32):
    """Dense 1-D tensor of `numel` elements with k = round(density * numel) non-zeros, ~N(0, 1).

    Positions are a uniform random k-subset of [0, numel), independent per (seed, rank): two ranks overlap in
    about k^2 / numel positions, so the union of n ranks holds about numel * (1 - (1 - density)^n).
    """
    k = _count(numel, density)
    gen = make_generator(seed, "uniform", numel, k, rank)
    if 4 * k >= numel:
        positions = torch.randperm(numel, generator=gen)[:k]
    else:
        # Sparse case: draw with replacement until k distinct, then a uniform k-subset of those (keeping the
        # smallest would bias low); cheaper than a permutation of all numel indices.
        found = torch.empty(0, dtype=torch.int64)
        while found.numel() < k:
            extra = torch.randint(0, numel, (int((k - found.numel()) * 1.1) + 16,), generator=gen)
            found = torch.unique(torch.cat([found, extra]))
        positions = found[torch.randperm(found.numel(), generator=gen)[:k]]
    return _scatter(numel, positions, _nonzero_normal(k, gen, dtype))


def _zipf_draws(numel, alpha, count, gen):
    """`count` indices in [0, numel) with P(i) proportional to w_i = integral from i+1 to i+2 of x^-alpha dx,
    a continuous Zipf law (w_i ~ (i+1.5)^-alpha), by inverting its CDF over x in [1, numel+1):

        alpha != 1:  x = (1 - u (1 - (numel+1)^(1-alpha)))^(1/(1-alpha))
        alpha == 1:  x = (numel+1)^u
    """
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-12:
        x = torch.exp(u * math.log(numel + 1.0))
    else:
        b = 1.0 - alpha
        x = (1.0 - u * (1.0 - (numel + 1.0) ** b)) ** (1.0 / b)
    return (x.floor().long() - 1).clamp_(0, numel - 1)


def _zipf_log_weights(numel, alpha):
    """log w_i for the law of _zipf_draws, i = 0 .. numel-1, computed without cancellation:

        w_i = (i+1)^(1-alpha) * (1 - (1 + 1/(i+1))^(1-alpha)) / (alpha - 1)     (alpha != 1)
        w_i = log(1 + 1/(i+1))                                                  (alpha == 1)
    """
    i1 = torch.arange(1, numel + 1, dtype=torch.float32)
    step = torch.log1p(1.0 / i1)
    if abs(alpha - 1.0) < 1e-12:
        return torch.log(step)
    b = 1.0 - alpha
    return b * torch.log(i1) + torch.log(torch.abs(torch.expm1(b * step))) - math.log(abs(alpha - 1.0))


def zipf(numel, density, rank=0, seed=0, dtype=torch.float32, alpha=1.1):
    """Dense 1-D tensor with k = round(density * numel) non-zeros at distinct, Zipf-skewed positions.

    The positions are a weighted sample without replacement with weights w_i ~ (i + 1.5)^-alpha: index 0 is
    the hottest, as in an embedding table with frequency-ordered ids. Every rank samples independently, so
    the hot head is shared by all ranks (small union growth there) and the tail is mostly private.

    Two exact methods for the same law: sparse k draws with replacement and keeps the first k distinct
    indices in draw order (successive sampling); dense k (or a sparse run that needs too many draws) takes
    the k largest of log w_i + Gumbel noise (the Gumbel top-k trick), O(numel).
    """
    if alpha <= 0:
        raise ValueError("alpha must be > 0")
    k = _count(numel, density)
    gen = make_generator(seed, "zipf", numel, k, rank, float(alpha))
    positions = None
    if 16 * k < numel:
        positions = _first_distinct(numel, k, lambda m: _zipf_draws(numel, alpha, m, gen), budget=4 * numel)
    if positions is None:
        u = torch.rand(numel, generator=gen).clamp_(min=1e-12)
        keys = _zipf_log_weights(numel, alpha) - torch.log(-torch.log(u))
        positions = torch.topk(keys, k, sorted=False).indices
    return _scatter(numel, positions, _nonzero_normal(k, gen, dtype))


def _first_distinct(numel, k, draw, budget):
    """The first k distinct values of the stream `draw(m)` (m values per call), or None after `budget` draws."""
    taken = torch.zeros(numel, dtype=torch.bool)
    parts, have, drawn, want = [], 0, 0, max(1024, 2 * k)
    while have < k:
        if drawn >= budget:
            return None
        m = min(want, 1 << 24)
        d = draw(m)
        drawn += m
        d = d[~taken[d]]
        if d.numel():
            uniq, inverse = torch.unique(d, return_inverse=True)
            first = torch.full((uniq.numel(),), d.numel(), dtype=torch.int64)
            first.scatter_reduce_(0, inverse, torch.arange(d.numel()), reduce="amin")
            new = d[torch.sort(first).values][: k - have]  # distinct, in order of first appearance
            taken[new] = True
            parts.append(new)
            have += new.numel()
            # next round: enough draws for the rest at this round's yield of new indices
            want = int((k - have) * m / max(new.numel(), 1)) + 1024
        else:
            want = 2 * m
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------------
# real text: the Python standard library


TOKEN_RE = re.compile(r"[A-Za-z_]+|\d+|[^\sA-Za-z_\d]")
UNK = "<unk>"


class StdlibCorpus:
    """The standard library's own *.py files as one word-level token stream (present on every machine).

    Files: every *.py under sysconfig.get_paths()["stdlib"] except site-packages / dist-packages (installed
    third-party code), in sorted path order. Tokens: TOKEN_RE (words, digit runs, single punctuation marks).
    Ids are frequency-ordered: id 0 is the most frequent token, as with real tokenizers, so the head of an
    embedding table is hot. With vocab_size, the vocab_size - 1 most frequent tokens are kept and the rest
    become <unk>, which takes the id its total count ranks it at (so ids stay frequency-ordered).

    Attributes: ids (int64 tensor, the stream), vocab (list of str, by id), counts (int64 tensor, by id),
    vocab_size, num_tokens, num_files, root. The tokenised corpus is cached in cache_dir (default
    ~/.cache/zen), keyed by Python version, stdlib path and cap; a second load takes ~0.2 s, and a second
    construction in the same process reuses the first (shared tensors: treat them as read-only).
    """

    FORMAT = 2
    _memo = {}  # cache path -> loaded data: constructing the corpus again in one process costs nothing

    def __init__(self, vocab_size=None, root=None, cache_dir=None, verbose=False):
        self.root = os.path.realpath(root or sysconfig.get_paths()["stdlib"])
        self.cap = None if vocab_size is None else int(vocab_size)
        if self.cap is not None and self.cap < 2:
            raise ValueError("vocab_size must be >= 2 (one word and <unk>)")
        cache_dir = os.path.expanduser(cache_dir or os.path.join("~", ".cache", "zen"))
        path = os.path.join(cache_dir, self._cache_name())
        t0 = time.perf_counter()
        data, how = StdlibCorpus._memo.get(path), "reused"
        if data is None:
            raw, how = self._load(path), "loaded from cache"
            if raw is None:
                # Ranks started together would all tokenise at once: the first builds under a file lock,
                # the others wait for it and then load its cache.
                os.makedirs(cache_dir, exist_ok=True)
                with open(path + ".lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    raw = self._load(path)
                    if raw is None:
                        raw, how = self._tokenise(), "tokenised"
                        self._save(path, raw)
            data = StdlibCorpus._memo[path] = self._unpack(raw)
        self.ids, self.vocab, self.counts, self.num_files = data
        if verbose:
            print(f"stdlib corpus {how} in {time.perf_counter() - t0:.1f} s: {self.num_files} files, "
                  f"{self.num_tokens} tokens, vocabulary {self.vocab_size}", file=sys.stderr)

    @property
    def vocab_size(self):
        return len(self.vocab)

    @property
    def num_tokens(self):
        return self.ids.numel()

    def _cache_name(self):
        where = hashlib.sha256(self.root.encode()).hexdigest()[:10]
        version = "{}{}.{}.{}".format(sys.implementation.name, *sys.version_info[:3])
        return f"stdlib-{version}-{where}-cap{self.cap or 'all'}-v{self.FORMAT}.pt"

    def files(self):
        skip = {"site-packages", "dist-packages", "__pycache__"}
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if d not in skip]
            out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
        return sorted(out)

    def _tokenise(self):
        files = self.files()
        tokens = []
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                tokens += TOKEN_RE.findall(f.read())
        counts = collections.Counter(tokens)
        if self.cap is not None and len(counts) > self.cap:
            kept = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: self.cap - 1]
            unk = sum(counts.values()) - sum(c for _, c in kept)
            counts = collections.Counter(dict(kept))
            counts[UNK] += unk
        # ties broken by the token itself, so the id order is the same on every machine
        order = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        vocab = [w for w, _ in order]
        index = {w: i for i, w in enumerate(vocab)}
        unk_id = index.get(UNK, -1)
        ids = torch.tensor([index.get(t, unk_id) for t in tokens], dtype=torch.int64)
        # Stored compactly (int32 ids, one newline-joined string; tokens hold no whitespace): loads in ~0.1 s.
        return {"format": self.FORMAT, "ids": ids.int(), "vocab": "\n".join(vocab),
                "counts": torch.tensor([c for _, c in order], dtype=torch.int64), "files": len(files)}

    @staticmethod
    def _unpack(data):
        return data["ids"].long(), data["vocab"].split("\n"), data["counts"], data["files"]

    def _load(self, path):
        try:
            data = torch.load(path, weights_only=True)
        except Exception:  # missing, truncated or from another torch: rebuild
            return None
        return data if isinstance(data, dict) and data.get("format") == self.FORMAT else None

    def _save(self, path, data):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save(data, tmp)
        os.replace(tmp, path)  # atomic: concurrent ranks never read half a file


def batch_token_ids(corpus, batch_tokens, rank=0, step=0, seed=0, window=64):
    """The token ids of one rank's batch: ceil(batch_tokens / window) windows of `window` consecutive tokens
    at uniform random offsets of the stream (like sequences of a language-model batch), cut to batch_tokens."""
    n_windows = -(-batch_tokens // window)
    gen = make_generator(seed, "batch", batch_tokens, window, rank, step)
    starts = torch.randint(0, corpus.num_tokens - window + 1, (n_windows,), generator=gen)
    return corpus.ids[(starts[:, None] + torch.arange(window)).reshape(-1)[:batch_tokens]]


def embedding_gradient(corpus, embedding_dim, batch_tokens, rank=0, step=0, seed=0, dtype=torch.float32,
                       window=64):
    """Flat (vocab_size * embedding_dim) gradient of an embedding table for one rank's batch.

    For a batch with token ids t_1 .. t_B, the gradient of the table E (vocab x dim) is

        dL/dE[v] = sum over j with t_j = v of g_j,

    g_j being the upstream gradient at position j (here i.i.d. N(0, 1) vectors). Rows of tokens absent from
    the batch are exactly zero, so the density is |distinct tokens in batch| / vocab_size, and frequent
    (small-id) rows are non-zero on every rank.
    """
    tokens = batch_token_ids(corpus, batch_tokens, rank, step, seed, window)
    gen = make_generator(seed, "upstream", batch_tokens, embedding_dim, rank, step)
    grad = torch.zeros(corpus.vocab_size, embedding_dim)
    grad.index_add_(0, tokens, torch.randn(tokens.numel(), embedding_dim, generator=gen))
    grad = grad.to(dtype)
    rows = torch.unique(tokens)
    present = grad[rows]
    if (present == 0).any():  # a sum that cancelled or underflowed to zero would lower the density
        present[present == 0] = 1
        grad[rows] = present
    return grad.reshape(-1)


def rows_to_flat(rows, dim):
    """Flat element indices of whole rows: row r covers [r * dim, (r + 1) * dim)."""
    return (rows[:, None] * dim + torch.arange(dim)).reshape(-1)


# ----------------------------------------------------------------------------------------------------------
# statistics


def union_growth(index_sets, ks):
    """gamma(k) = |union of index_sets[0..k-1]| / mean over those k of |index_sets[i]|, for each k in ks.

    gamma(1) = 1; gamma(k) = k when the ranks share nothing, 1 when they all hold the same indices. It is the
    factor by which the reduced result outgrows one rank's input (the "pull" volume of Balanced Parallelism).
    """
    out = {}
    for k in ks:
        sets = index_sets[:k]
        if len(sets) < k:
            raise ValueError(f"gamma({k}) needs {k} index sets, got {len(index_sets)}")
        mean = sum(s.numel() for s in sets) / k
        out[k] = torch.unique(torch.cat(sets)).numel() / mean if mean else float("nan")
    return out


def contiguous_imbalance(indices, numel, parts):
    """max / mean load when [0, numel) is cut into `parts` contiguous ranges of (nearly) equal length.

    Index i belongs to range floor(i * parts / numel); the ranges differ in length by at most one element.
    Load = number of the given indices in a range; mean = len(indices) / parts. 1.0 is perfect balance,
    `parts` the worst (everything in one range). No indices at all counts as balanced (1.0).
    (The hash partition's imbalance is computed with zen.ops.hash_partition, not here.)
    """
    indices = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
    if indices.numel() == 0:
        return 1.0
    load = torch.bincount(indices * parts // numel, minlength=parts)
    return load.max().item() / (indices.numel() / parts)


# ----------------------------------------------------------------------------------------------------------


def _report(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description="Statistics of the real-text embedding-gradient workload")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="steps averaged over")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    corpus = StdlibCorpus(args.vocab_size, verbose=True)
    V = corpus.vocab_size
    top = ", ".join(f"{w!r}" for w in corpus.vocab[:10])
    print(f"vocabulary {V}, tokens {corpus.num_tokens}, files {corpus.num_files}; most frequent: {top}")
    ks = [k for k in (2, 4, 8, 16) if k <= args.ranks]
    parts = (4, 8, 16)
    dens, gam, rank_imb, union_imb = [], {k: [] for k in ks}, {p: [] for p in parts}, {p: [] for p in parts}
    for step in range(args.steps):
        rows = [torch.unique(batch_token_ids(corpus, args.batch_tokens, r, step, args.seed, args.window))
                for r in range(args.ranks)]
        dens += [x.numel() / V for x in rows]
        for k, g in union_growth(rows, ks).items():
            gam[k].append(g)
        union = torch.unique(torch.cat(rows[: min(8, args.ranks)]))
        for p in parts:
            rank_imb[p] += [contiguous_imbalance(x, V, p) for x in rows]
            union_imb[p].append(contiguous_imbalance(union, V, p))

    def mean(xs):
        return sum(xs) / len(xs)

    print(f"batch {args.batch_tokens} tokens per rank (windows of {args.window}), {args.ranks} ranks, "
          f"{args.steps} steps, seed {args.seed}")
    print(f"density per rank: mean {100 * mean(dens):.2f}% (min {100 * min(dens):.2f}%, max {100 * max(dens):.2f}%)"
          f" = {mean(dens) * V:.0f} distinct rows of {V}")
    print("gamma(k): " + ", ".join(f"{k}: {mean(gam[k]):.2f}" for k in ks))
    print("contiguous max/mean, one rank's rows: " + ", ".join(f"{p} parts {mean(rank_imb[p]):.2f}" for p in parts))
    print(f"contiguous max/mean, union of {min(8, args.ranks)} ranks: "
          + ", ".join(f"{p} parts {mean(union_imb[p]):.2f}" for p in parts))


if __name__ == "__main__":
    _report()
