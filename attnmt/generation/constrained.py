"""Lexically constrained beam search: every hypothesis contains every given target phrase.

The search is dynamic beam allocation (Post & Vilar, 2018) with the vectorised banks of Hu et al. (2019), the
meaning of fairseq's ``--constraints``: each hypothesis tracks how far it has come through its sentence's
constraints; at each step the candidates are the best ``2 * beam`` extensions overall, each hypothesis' best
one and, for each hypothesis, every token that would advance it through a constraint; a candidate's **bank** is
the number of constraint tokens it has met; the candidates, sorted by bank and score, are dealt round robin
across the banks (the best of the highest bank first, then the best of the next, ...), and the first ``2 * beam``
of that order are the step's candidates. EOS is barred until a hypothesis has met all its constraints.

``ordered`` constraints must appear in the given order; ``unordered`` ones (the default) in any order, as a trie
of the phrases (a phrase that is cut off by another token starts over). Each sentence's constraints are compiled
once into a small automaton (states x constraint tokens -> state, with each state's bank, whether it is finished
and the tokens that advance it), so that the whole batch advances with tensor lookups at every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnmt.generation.beam import BeamSearch, BeamSearchConfig
from attnmt.generation.search import NEG_INF, Guidance, Symbols, step_log_probs
from attnmt.registry import register

MAX_STATES = 4096  # per sentence: far above what a few phrases of a few tokens need


# ------------------------------------------------------------------------------------------------ automata


@dataclass(frozen=True)
class _Trie:
    """The unordered constraints as a trie: node 0 is the root; per node its token, parent, children, how many
    phrases end there (``terminal``) and pass through it (``through``)."""

    token: tuple[int, ...]
    parent: tuple[int, ...]
    children: tuple[dict, ...]
    terminal: tuple[int, ...]
    through: tuple[int, ...]

    @classmethod
    def of(cls, phrases: Sequence[Sequence[int]]) -> _Trie:
        token, parent, children, terminal, through = [-1], [-1], [{}], [0], [0]
        for phrase in phrases:
            node = 0
            path = [0]
            for t in phrase:
                nxt = children[node].get(t)
                if nxt is None:
                    nxt = len(token)
                    token.append(t)
                    parent.append(node)
                    children.append({})
                    terminal.append(0)
                    through.append(0)
                    children[node][t] = nxt
                node = nxt
                path.append(node)
            terminal[node] += 1
            for n in path:
                through[n] += 1
        return cls(tuple(token), tuple(parent), tuple(children), tuple(terminal), tuple(through))


class _Unordered:
    """States of unordered constraints: (node, generated counts per node, completed counts per node)."""

    def __init__(self, phrases):
        self.trie = _Trie.of(phrases)
        n = len(self.trie.token)
        self.start = (0, (0,) * n, (0,) * n)

    def bank(self, s) -> int:
        return sum(s[1])

    def finished(self, s) -> bool:
        node, _, completed = s
        t = self.trie
        pending = 1 if t.terminal[node] and completed[node] < t.terminal[node] else 0
        return t.through[0] - (sum(completed) + pending) == 0

    def next_tokens(self, s) -> set[int]:
        t = self.trie
        out = set(t.children[0])
        if s[0] != 0:
            out |= set(t.children[s[0]])
        return out

    def advance(self, s, tok: int):
        t = self.trie
        node, gen, comp = s
        gen, comp = list(gen), list(comp)
        child = t.children[node].get(tok)
        if child is not None and gen[child] < t.through[child]:
            gen[child] += 1
            return (child, tuple(gen), tuple(comp))
        # off the path: back to the root, crediting a phrase the path completed, else undoing the path's visits
        top = t.children[0].get(tok)
        target = top if top is not None and gen[top] < t.through[top] else 0
        if target:
            gen[target] += 1
        n = node
        while n != 0:
            if t.terminal[n] and s[2][n] < t.terminal[n]:
                comp[n] += 1
                break
            gen[n] -= 1
            n = t.parent[n]
        return (target, tuple(gen), tuple(comp))


class _Ordered:
    """States of ordered constraints: how many tokens of the phrases, one after the other, are met (-1: none)."""

    def __init__(self, phrases):
        self.seq = [t for p in phrases for t in p]
        self.ends = [i == len(p) - 1 for p in phrases for i in range(len(p))]
        self.start = -1

    def bank(self, s) -> int:
        return s + 1

    def finished(self, s) -> bool:
        return s + 1 == len(self.seq)

    def next_tokens(self, s) -> set[int]:
        out = set()
        if s > 0:
            out.add(self.seq[0])
        if not self.finished(s):
            out.add(self.seq[s + 1])
        return out

    def advance(self, s, tok: int):
        if self.finished(s):
            return s
        if self.seq[s + 1] == tok:
            return s + 1
        if s == -1 or self.ends[s]:  # between phrases anything may come
            return s
        return 0 if tok == self.seq[0] else -1


@dataclass
class Automaton:
    """One sentence's constraints compiled: ``tokens`` (T,) the distinct constraint tokens; ``table`` (S, T + 1)
    the next state per token (column T: any other token); per state its ``bank``, ``finished`` and the
    ``advancing`` tokens (padded with -1)."""

    tokens: list[int]
    table: list[list[int]]
    bank: list[int]
    finished: list[bool]
    advancing: list[list[int]]

    @classmethod
    def compile(cls, phrases: Sequence[Sequence[int]], order: str, where: str = "constraints") -> Automaton:
        phrases = [list(p) for p in phrases if len(p)]
        machine = _Ordered(phrases) if order == "ordered" else _Unordered(phrases)
        tokens = sorted({t for p in phrases for t in p})
        other = -1 if not tokens else min(-2, -1 - max(tokens))  # a token id that is not a constraint's
        index = {machine.start: 0}
        states, table = [machine.start], []
        while len(table) < len(states):
            s = states[len(table)]
            row = []
            for tok in [*tokens, other]:
                nxt = machine.advance(s, tok)
                if nxt not in index:
                    if len(states) >= MAX_STATES:
                        raise ValueError(f"{where}: too many constraint phrases or tokens to search for at once "
                                         f"({len(phrases)} phrases, {sum(map(len, phrases))} tokens); give fewer")
                    index[nxt] = len(states)
                    states.append(nxt)
                row.append(index[nxt])
            table.append(row)
        return cls(tokens, table, [machine.bank(s) for s in states], [machine.finished(s) for s in states],
                   [sorted(machine.next_tokens(s)) for s in states])


class BatchAutomata:
    """The automata of a batch's sentences as padded tensors, and the state of every row."""

    def __init__(self, machines: list[Automaton], device):
        B = len(machines)
        S = max(len(m.table) for m in machines)
        T = max(1, max(len(m.tokens) for m in machines))
        N = max(1, max((len(a) for m in machines for a in m.advancing), default=1))
        self.tokens = torch.full((B, T), -1, dtype=torch.long)
        self.table = torch.zeros((B, S, T + 1), dtype=torch.long)
        self.bank = torch.zeros((B, S), dtype=torch.long)
        self.finished = torch.ones((B, S), dtype=torch.bool)
        self.advancing = torch.full((B, S, N), -1, dtype=torch.long)
        self.distinct = torch.tensor([len(m.tokens) for m in machines], dtype=torch.long)
        for b, m in enumerate(machines):
            n, t = len(m.table), len(m.tokens)
            self.tokens[b, :t] = torch.tensor(m.tokens, dtype=torch.long)
            tab = torch.tensor(m.table, dtype=torch.long)
            self.table[b, :n, :t] = tab[:, :t]
            self.table[b, :n, T] = tab[:, t]
            self.bank[b, :n] = torch.tensor(m.bank, dtype=torch.long)
            self.finished[b, :n] = torch.tensor(m.finished, dtype=torch.bool)
            for s, adv in enumerate(m.advancing):
                self.advancing[b, s, :len(adv)] = torch.tensor(adv, dtype=torch.long)
        for name in ("tokens", "table", "bank", "finished", "advancing", "distinct"):
            setattr(self, name, getattr(self, name).to(device))
        self.T = T

    def advance(self, sent: Tensor, state: Tensor, tok: Tensor) -> Tensor:
        """The states after ``tok`` (any shape; ``sent``/``state`` broadcast to it)."""
        hit = tok[..., None] == self.tokens[sent]  # (..., T)
        col = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(tok, self.T))
        return self.table[sent, state, col]


# ------------------------------------------------------------------------------------------------ search


@register("search", "constrained", config=BeamSearchConfig)
class ConstrainedBeamSearch(BeamSearch):
    """Beam search in which every hypothesis contains each sentence's constraints (see the module docstring):
    chosen for the sentences that have constraints (``Guidance.constraints``); the others of the batch are
    searched as beam search searches them (a sentence without constraints has one bank)."""

    def guide(self, guide: Guidance, sym: Symbols, max_len: Tensor) -> None:
        B = max_len.size(0)
        constraints = guide.constraints if guide.constraints is not None else [[] for _ in range(B)]
        prefixes = guide.prefixes or [[] for _ in range(B)]
        order = "ordered" if guide.ordered else "unordered"
        for b, phrases in enumerate(constraints):
            need = sum(len(p) for p in phrases) + len(prefixes[b])
            if need > int(max_len[b]):
                raise ValueError(f"sentence {b}: its constraints{' and prefix' if prefixes[b] else ''} need {need} "
                                 f"tokens but at most {int(max_len[b])} may be generated; give fewer or shorter "
                                 f"ones, or raise --max-len-a/--max-len-b")
        self.machines = [Automaton.compile(p, order, f"sentence {b}") for b, p in enumerate(constraints)]
        super().guide(Guidance(guide.prefixes, suppress=guide.suppress), sym, max_len)

    def start(self, model, src_tokens, src_lengths, kernels, sample_ids):
        dev = src_tokens.device
        self.automata = BatchAutomata(self.machines, dev)
        K = self.cfg.beam
        self.sent = torch.arange(src_tokens.size(0), device=dev)  # per unit: its sentence
        self.state = torch.zeros(src_tokens.size(0) * K, dtype=torch.long, device=dev)  # per row
        return super().start(model, src_tokens, src_lengths, kernels, sample_ids)

    def candidates(self, model, tokens, step, enc, cache, max_len, scores, sym, kernels):
        K, auto = self.cfg.beam, self.automata
        logits = model.decode(tokens[:, step:step + 1], enc, cache)[:, -1]
        lprobs = step_log_probs(logits, step, max_len, tokens[:, 1:step + 1], self.cfg, sym, rules=self.rules)
        A, V = lprobs.size(0) // K, lprobs.size(1)
        row_sent = self.sent.repeat_interleave(K)
        unfinished = ~auto.finished[row_sent, self.state]
        lprobs[unfinished, sym.eos] = NEG_INF
        total = lprobs + scores[:, None]  # (R, V) cumulative
        dev = lprobs.device
        # the best 2K extensions of each unit, each row's best one, and every row's advancing tokens
        C = min(2 * K, K * V - 1)
        top_s, top_j = total.view(A, K * V).topk(C, dim=1)
        parts_tok, parts_beam, parts_ok = [top_j % V], [top_j // V], [torch.ones_like(top_j, dtype=torch.bool)]
        first = step == 0  # the rows of a unit start alike: only its first row contributes
        row_ok = torch.ones((A, K), dtype=torch.bool, device=dev)
        if first:
            row_ok[:, 1:] = False
        else:
            best = total.argmax(dim=1).view(A, K)
            parts_tok.append(best)
            parts_beam.append(torch.arange(K, device=dev).expand(A, K))
            parts_ok.append(row_ok)
        adv = auto.advancing[row_sent, self.state].view(A, K, -1)  # (A, K, N)
        N = adv.size(2)
        parts_tok.append(adv.clamp(min=0).view(A, K * N))
        parts_beam.append(torch.arange(K, device=dev).repeat_interleave(N).expand(A, K * N))
        parts_ok.append(((adv >= 0) & row_ok[:, :, None]).view(A, K * N))
        tok = torch.cat(parts_tok, dim=1)
        beam = torch.cat(parts_beam, dim=1)
        ok = torch.cat(parts_ok, dim=1)
        rows = torch.arange(A, device=dev)[:, None] * K + beam
        cand = total[rows, tok]
        lp = lprobs[rows, tok]
        state = auto.advance(self.sent[:, None], self.state[rows], tok)
        bank = auto.bank[self.sent[:, None], state]
        # sort by (bank, score) as fairseq keys it; invalid entries last
        key = (auto.distinct[self.sent][:, None] - bank).float() * -100.0 + cand
        key = key.masked_fill(~ok, NEG_INF)
        order = torch.sort((~ok).long(), dim=1, stable=True).indices
        order = order.gather(1, torch.sort(key.gather(1, order), dim=1, descending=True, stable=True).indices)
        tok, beam, cand, lp, state, bank, ok = (x.gather(1, order) for x in (tok, beam, cand, lp, state, bank, ok))
        # drop a candidate equal to the one before it (the same row and token)
        ident = beam * (V + 1) + tok
        dup = torch.zeros_like(ok)
        dup[:, 1:] = ident[:, 1:] == ident[:, :-1]
        keep = ok & ~dup
        order = torch.sort((~keep).long(), dim=1, stable=True).indices
        tok, beam, cand, lp, state, bank, keep = (x.gather(1, order) for x in (tok, beam, cand, lp, state, bank, keep))
        # deal round robin across the banks: rank within each run of equal bank, striped
        M = tok.size(1)
        pos = torch.arange(M, device=dev).expand(A, M)
        run_start = torch.ones_like(keep)
        run_start[:, 1:] = bank[:, 1:] != bank[:, :-1]
        rank = pos - torch.where(run_start, pos, torch.zeros_like(pos)).cummax(dim=1).values
        n_unique = keep.sum(dim=1, keepdim=True)
        stripe = (auto.distinct[self.sent][:, None] - bank) + rank * (n_unique + 1)
        stripe = stripe.masked_fill(~keep, torch.iinfo(torch.long).max)
        order = torch.sort(stripe, dim=1, stable=True).indices[:, :C]
        tok, beam, cand, lp, state, keep = (x.gather(1, order) for x in (tok, beam, cand, lp, state, keep))
        cand = cand.masked_fill(~keep, NEG_INF)
        self.cand_state = state
        return cand, lp, beam, tok

    def chosen(self, sel: Tensor) -> None:
        self.state = self.cand_state.gather(1, sel).reshape(-1)

    def keep_units(self, keep: Tensor) -> None:
        super().keep_units(keep)
        K = self.cfg.beam
        self.sent = self.sent[keep]
        self.state = self.state.view(-1, K)[keep].reshape(-1)


def parse_constraint_line(line: str) -> tuple[str, list[str]]:
    """fairseq's input line with constraints: the source, then TAB-separated target phrases."""
    source, *phrases = line.rstrip("\n").split("\t")
    return source, [p for p in (q.strip() for q in phrases) if p]
