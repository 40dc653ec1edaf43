# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The host side of MTP speculation (strata.engine.speculate) that runs every verify window, typed.

- greedy_accept(drafts, picks): the longest prefix of drafts equal to the target's picks [N + 1]
  -> (a, the target's token at row a); greedy_accept_rows does the same over logits rows (argmax).
- accept_sampled(logits, drafts, qs, params, draw, probs): speculative sampling's acceptance, with
  every draw in speculate.accept_py's order: p from probs(row, params) (strata.engine.sampler's
  probs_host, numpy, passed in: _ext never imports the engine), u * q[d] < p[d], and the residual
  max(0, p - q) drawn without a temporary array, by choose's rule (sequential cumulative sum,
  each partial divided by the last, the first one past u).
- choose(probs, u): strata.engine.sampler.choose over float64 probabilities, bit for bit.
- AutoDrafts: --spec auto's rule, speculate.AutoDraftsPy's state and choices in C arrays.
- DrafterRows: MtpDrafter's per-window bookkeeping (done, the pending hidden rows, covered,
  reusable, truncate, extend); MtpDrafter subclasses it, its model calls stay in Python.

speculate.py's Python versions are the oracle: tests/engine/test_spec_host.py checks each against
its twin (the same tokens for the same draws, the same choices over thousands of windows).
"""

from libc.math cimport fabs, pow

import numpy as np

cdef extern from *:
    """
    /* max(r, 0) as one maxsd: a branch on the sign of p - q mispredicts a quarter of the time */
    static inline double strata_spec_pos(double r) { return r > 0.0 ? r : 0.0; }
    """
    double strata_spec_pos(double r) noexcept nogil

# acceptance ------------------------------------------------------------------------------------------

def greedy_accept(drafts, picks):
    """drafts [N] and the target's picks [N + 1] (ints) -> (a, picks[a]): a = the first row where
    they differ (N when none does)."""
    cdef Py_ssize_t j, n = len(drafts)
    for j in range(n):
        t = picks[j]
        if <long long>drafts[j] != <long long>t:
            return j, int(t)
    return n, int(picks[n])


def greedy_accept_rows(logits, drafts):
    """greedy_accept over verify logits [N + 1, V]: each row's argmax (numpy's: its SIMD loop beats
    a scalar one here, and NaN and ties go as accept_py's), row by row until the first disagreement."""
    cdef Py_ssize_t j, n = len(drafts), t
    for j in range(n):
        t = logits[j].argmax()
        if <Py_ssize_t>drafts[j] != t:
            return j, t
    return n, int(logits[n].argmax())


cdef double[::1] _cdf = np.empty(0)       # choose's cumulative sums, kept between calls


cdef Py_ssize_t _choose(const double* p, const double* q, Py_ssize_t V, double u, bint residual):
    """choose(r, u) for r = p, or r = max(p - q, 0) with residual: the cumulative sum taken in order
    (np.cumsum's), each partial over the last (cdf /= cdf[-1]), the first index whose value passes u
    (searchsorted side="right", a bisection over the quotients: they never decrease), at most V - 1."""
    global _cdf
    if _cdf.shape[0] < V:
        _cdf = np.empty(V)
    cdef double* cdf = &_cdf[0]
    cdef Py_ssize_t i, lo = 0, hi = V, mid
    cdef double c = 0.0, total
    with nogil:
        if residual:
            for i in range(V):
                c += strata_spec_pos(p[i] - q[i])
                cdf[i] = c
        else:
            for i in range(V):
                c += p[i]
                cdf[i] = c
        total = c
        while lo < hi:                          # the first i with cdf[i] / total > u
            mid = (lo + hi) // 2
            if cdf[mid] / total > u:
                hi = mid
            else:
                lo = mid + 1
    return lo if lo < V else V - 1


cdef bint _residual_positive(const double* p, const double* q, Py_ssize_t V) noexcept nogil:
    """np.maximum(p - q, 0).sum() > 0: a sum of non-negative numbers is positive iff one of them is."""
    cdef Py_ssize_t i
    for i in range(V):
        if p[i] - q[i] > 0.0:
            return True
    return False


def choose(const double[::1] probs, double u):
    """strata.engine.sampler.choose(probs, u) for float64 probs, bit for bit."""
    return _choose(&probs[0], NULL, probs.shape[0], u, False)


def accept_sampled(logits, drafts, qs, params, draw, probs):
    """speculate.accept_py for temperature > 0 -> (a, token): row j's p = probs(logits[j], params)
    (float64 [V]); draft d_j is kept if draw() * q_j[d_j] < p[d_j], else the token is drawn from
    max(0, p - q_j) renormalized (p where that is all zero); all kept: drawn from the last row's p."""
    cdef Py_ssize_t j, n = len(drafts), d, V
    cdef const double[::1] p
    cdef const double[::1] q
    cdef double u
    for j in range(n):
        p = probs(logits[j], params)
        q = qs[j]
        d = drafts[j]
        if draw() * q[d] < p[d]:
            continue
        V = p.shape[0]
        u = draw()
        if _residual_positive(&p[0], &q[0], V):
            return j, _choose(&p[0], &q[0], V, u, True)
        return j, _choose(&p[0], NULL, V, u, False)
    p = probs(logits[n], params)
    return n, _choose(&p[0], NULL, p.shape[0], draw(), False)


# --spec auto -----------------------------------------------------------------------------------------

cdef enum:
    MAX_N = 64          # drafts per window the rule can track (the CLI allows 7)
    MAX_KEEP = 64       # window times kept per N
    MAX_PARTIALS = 64   # fsum's non-overlapping partials: doubles' exponents allow about 40


cdef double _fsum(const double* x, int count) noexcept nogil:
    """math.fsum over count doubles: the correctly rounded sum (Shewchuk's partials, CPython's
    final half-even correction), so the mean is the same on every Python (3.12's sum() is
    compensated, 3.11's is not: both classes use fsum)."""
    cdef double partials[MAX_PARTIALS]
    cdef int i, j, k, m = 0
    cdef double v, y, t, hi = 0.0, lo = 0.0, yr
    for i in range(count):
        v = x[i]
        k = 0
        for j in range(m):
            y = partials[j]
            if fabs(v) < fabs(y):
                t = v
                v = y
                y = t
            hi = v + y
            lo = y - (hi - v)
            if lo != 0.0:
                partials[k] = lo
                k += 1
            v = hi
        m = k
        partials[m] = v
        m += 1
    hi = 0.0
    if m > 0:
        m -= 1
        hi = partials[m]
        lo = 0.0
        while m > 0:
            v = hi
            m -= 1
            y = partials[m]
            hi = v + y
            yr = hi - v
            lo = y - yr
            if lo != 0.0:
                break
        if m > 0 and ((lo < 0.0 and partials[m - 1] < 0.0) or (lo > 0.0 and partials[m - 1] > 0.0)):
            y = lo * 2.0
            v = hi + y
            yr = v - hi
            if y == yr:
                hi = v
    return hi


def fsum(values):
    """_fsum over a sequence of floats (for the tests: math.fsum's twin)."""
    cdef double buf[MAX_KEEP]
    cdef int i, count = len(values)
    if count > MAX_KEEP:
        raise ValueError(f"fsum: at most {MAX_KEEP} values")
    for i in range(count):
        buf[i] = values[i]
    return _fsum(buf, count)


cdef class AutoDrafts:
    """speculate.AutoDraftsPy (read its doc: the rule) with its state in C arrays: per N the last
    `keep` window times (a ring) and their mean (updated in observe), the order in which each N was
    first measured (max() over a dict keeps the first maximum in that order), when it was last."""
    cdef public int max_n, probe, max_probe, keep, settle
    cdef public long long gap, next_probe, windows, kept, tried
    cdef public bint probing, climbing
    cdef public int n
    cdef double times[MAX_N + 1][MAX_KEEP]
    cdef int count[MAX_N + 1]           # times held for N (at most keep)
    cdef int head[MAX_N + 1]            # the ring's oldest time
    cdef double mean[MAX_N + 1]
    cdef long long seen_at[MAX_N + 1]   # -1: never measured
    cdef int order[MAX_N + 1]           # N in the order each was first measured
    cdef int measured

    def __init__(self, int max_n, int probe=32, int max_probe=1024, int keep=16, int settle=64):
        if not 0 <= max_n <= MAX_N or not 1 <= keep <= MAX_KEEP:
            raise ValueError(f"AutoDrafts: max_n {max_n} (0..{MAX_N}), keep {keep} (1..{MAX_KEEP})")
        self.max_n, self.probe, self.max_probe, self.keep = max_n, probe, max_probe, keep
        self.settle = settle
        self.gap, self.next_probe = probe, probe
        self.probing, self.climbing = False, True
        self.kept = self.tried = self.windows = 0
        self.measured = 0
        self.n = max_n
        cdef int i
        for i in range(MAX_N + 1):
            self.count[i] = self.head[i] = 0
            self.mean[i] = 0.0
            self.seen_at[i] = -1

    @property
    def alpha(self) -> float:
        return self._alpha()

    cdef inline double _alpha(self) noexcept:
        return <double>(self.kept + 1) / <double>(self.tried + 2)

    cdef double _rate(self, int n, double a) noexcept:
        cdef double tokens = n + 1 if a >= 1.0 else (1.0 - pow(a, n + 1)) / (1.0 - a)
        return tokens / self.mean[n]

    def tokens_per_ms(self, int n) -> float:
        if not 0 <= n <= MAX_N or self.seen_at[n] < 0:
            raise KeyError(n)
        return self._rate(n, self._alpha())

    cdef int _best(self) noexcept:
        """max(window_ms, key=tokens_per_ms): the first N (in measuring order) of the highest rate."""
        cdef double a = self._alpha(), r, top = 0.0
        cdef int i, best = -1
        for i in range(self.measured):
            r = self._rate(self.order[i], a)
            if best < 0 or r > top:
                best, top = self.order[i], r
        return best

    cpdef int choose(self) except -1:
        cdef int n, best, lo, hi
        if self.climbing:
            n = self.measured - 1
            if n < 0:
                n = 0
            if self.count[n] < 2:
                return n
            n = self.measured - 1
            if n < self.max_n and self._best() == n:
                return n + 1
            self.climbing = False
        best = self._best()
        if self.probing:
            self.probing = False
            self.gap = (self.probe if best != self.n or self.tried < self.settle
                        else min(2 * self.gap, <long long>self.max_probe))
            self.next_probe = self.windows + self.gap
        self.n = best
        if self.windows >= self.next_probe:
            self.probing = True
            lo, hi = best - 1, best + 1
            if lo < 0 and hi > self.max_n:
                raise ValueError("min() arg is an empty sequence")    # AutoDraftsPy with max_n 0
            if lo < 0:
                return hi
            if hi > self.max_n:
                return lo
            return lo if self.seen_at[lo] <= self.seen_at[hi] else hi
        return best

    cpdef observe(self, int n, long long accepted, double ms):
        if not 0 <= n <= MAX_N:
            raise ValueError(f"AutoDrafts.observe: {n} drafts (0..{MAX_N})")
        cdef int k = self.keep, c = self.count[n], i
        if self.seen_at[n] < 0:
            self.order[self.measured] = n
            self.measured += 1
        if c < k:
            self.times[n][(self.head[n] + c) % k] = ms
            self.count[n] = c + 1
        else:
            self.times[n][self.head[n]] = ms
            self.head[n] = (self.head[n] + 1) % k
        cdef double ordered[MAX_KEEP]
        c = self.count[n]
        for i in range(c):
            ordered[i] = self.times[n][(self.head[n] + i) % k]
        self.mean[n] = _fsum(ordered, c) / c
        self.seen_at[n] = self.windows
        self.windows += 1
        self.kept += accepted
        self.tried += accepted + (1 if accepted < n else 0)

    @property
    def window_ms(self) -> dict:
        """N -> its recent window times, oldest first, N in the order first measured (AutoDraftsPy's)."""
        cdef int i, j, n
        return {self.order[i]: [self.times[self.order[i]][(self.head[self.order[i]] + j) % self.keep]
                                for j in range(self.count[self.order[i]])]
                for i in range(self.measured)}

    @property
    def seen(self) -> dict:
        cdef int i
        return {self.order[i]: self.seen_at[self.order[i]] for i in range(self.measured)}

    def to_dict(self) -> dict:
        cdef int i
        return {"n": self.n, "alpha": self._alpha(),
                "window_ms": {n: self.mean[n] for n in sorted(self.order[i] for i in range(self.measured))}}


# the drafter's rows ----------------------------------------------------------------------------------

cdef class DrafterRows:
    """MtpDrafter's bookkeeping for one sequence (speculate.DrafterRowsPy's twin): cells 0..done-1
    of the MTP layer are final; the main hidden rows of positions done.. wait for their next token,
    kept as the pieces extend() gave (joined when `pending` is read) with their row count."""
    cdef public long long done
    cdef list _pieces
    cdef long long _rows

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.done = 0
        self._pieces = []
        self._rows = 0

    @property
    def pending(self):
        """Main hidden [P, D] of positions done..done+P-1 (None: P = 0)."""
        if len(self._pieces) > 1:
            self._pieces = [np.concatenate(self._pieces)]
        return self._pieces[0] if self._pieces else None

    @pending.setter
    def pending(self, rows) -> None:
        if rows is None or rows.shape[0] == 0:
            self._pieces, self._rows = [], 0
        else:
            self._pieces, self._rows = [rows], rows.shape[0]

    @property
    def covered(self) -> int:
        """Tokens from position 0 for which the drafter can go on (final cells + pending states)."""
        return self.done + self._rows

    def reusable(self, cached_ids, ids, long long n) -> int:
        """The reusable prefix n of ids over cached_ids, cut past the covered tokens, and by one
        where cell n-1 is final but was written with a next token other than ids[n]."""
        cdef long long covered = self.done + self._rows
        if n > covered:
            n = covered
        if 0 < n <= self.done and (n >= len(cached_ids) or cached_ids[n] != ids[n]):
            n -= 1
        return n

    def truncate(self, long long length) -> None:
        """The sequence is cut back to `length` tokens (a prompt read from there)."""
        if length <= self.done:
            self.done, self.pending = length, None
        elif self._pieces:
            self.pending = self.pending[:length - self.done]

    def extend(self, hidden) -> None:
        """Main hidden states [T, D] of the next T positions after covered (copied)."""
        self._pieces.append(hidden.copy())
        self._rows += hidden.shape[0]
