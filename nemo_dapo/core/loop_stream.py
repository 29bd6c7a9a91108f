"""The streaming generation paths of the DAPO step loop (core/loop.py), apart from its batch path and update.

``StreamingPhase`` is a mixin of ``DAPOLoop``: its methods read the loop's settings, prompts, filler, generator and
counters. Streaming (``rollout.streaming``, world size 1) scores each group as soon as its G responses are done and
acts on ``on_filler_full`` the moment the filler is full: ``abort`` / ``finish`` the rest of the batch, or
``suspend`` it (partial rollouts, core/partial.py: the unfinished groups are kept, with the weight version that
drew each token, and continued by the next generation batch unless more than ``max_staleness`` versions old).
With ``overlap`` the suspension waits: the stream runs on through the update with the next batch's prompts added
(``_draw_ahead``), and is parked just before the refit (``_park_live``). Partial rollouts in prompt order
(``_stream_rounds``) generate in rounds of ``round_tokens`` tokens per sample instead, so that where a suspended
sample stopped does not depend on the engine's timing; their overlap is one round (``_round_ahead``) of the groups
carried over and the next batch's first prompts, submitted when the batch is full and waited for before the refit.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from nemo_dapo.core.loop_data import mix_seed
from nemo_dapo.core.types import Generation
from nemo_dapo.core.partial import (SampleState, SuspendedGroup, assemble, complete, continuation_requests,
                                    reopen_round_cuts, split_stale, stamp, suspend)


@dataclass
class _Live:
    """A stream left running past the filler (overlap): what parking it needs."""
    stream: object
    who: list  # [(prompt index, uid)] per stream key
    seeds: list
    resumed: list  # SuspendedGroup per key < len(resumed)
    counted: int  # generated tokens already counted


class StreamingPhase:
    """Phase 1's streamed generation batches (see the module docstring); mixed into ``DAPOLoop``."""

    def _stream_and_score(self, indices, uids, timers) -> list:
        """Score each group as it finishes and hand it to the filler (``fill_order`` "finish"), or hand the scored
        groups over in prompt order ("prompt": group k waits for groups 0..k-1); once the filler is full apply
        ``on_filler_full``. Returns the groups handed over; with abort, finished groups not handed over are counted
        as aborted tokens."""
        s, g = self.settings, self.settings.group_size
        prompt_ids, prompt_mask = self.prompts.collate(indices)
        t0 = time.perf_counter()
        stream = self.generator.stream(prompt_ids, prompt_mask, n=g, max_new_tokens=s.max_new_tokens,
                                       temperature=s.temperature, top_p=s.top_p, seed=self._seed())
        groups, t_scoring = [], 0.0
        held, next_k, dropped = {}, 0, []  # prompt order: scored groups waiting for the ones drawn before them
        for k, out in stream:
            t1 = time.perf_counter()
            group = self._score([indices[k]], [uids[k]], prompt_ids[k:k + 1], prompt_mask[k:k + 1], out, timers)
            t_scoring += time.perf_counter() - t1
            ready = group
            if s.fill_order == "prompt":
                held[k], ready = group, []
                while next_k in held:
                    ready.extend(held.pop(next_k))
                    next_k += 1
            stop = False
            for j, one in enumerate(ready):
                was_full = self.filler.full()
                groups.append(one)
                self.filler.add_groups([one])
                if self.filler.full() and not was_full:
                    timers["filled_at"] = time.perf_counter()
                    # suspend here: max_staleness 0 (partial rollouts go through _stream_partial)
                    if s.on_filler_full in ("abort", "suspend"):
                        stop, dropped = True, ready[j + 1:] + [x for rest in held.values() for x in rest]
                        break
            if stop:
                if not stream.done:
                    stream.abort()
                break
        timers["gen"] += time.perf_counter() - t0 - t_scoring
        self.counters["generated_tokens"] += stream.generated_tokens
        self.counters["aborted_tokens"] += stream.aborted_tokens + sum(x.payload.num_tokens() for x in dropped)
        timers["aborted_requests"] = timers.get("aborted_requests", 0) + stream.aborted_requests
        return groups

    def _resumable(self) -> list:
        """The suspended groups the current weights may continue; the others are dropped and counted."""
        keep, drop = split_stale(self._suspended, self._version, self.max_staleness)
        self._suspended = []
        p = self.partial_counters
        p["stale_groups"] += len(drop)
        p["stale_tokens"] += sum(g.num_tokens() for g in drop)
        p["resumed_groups"] += len(keep)
        p["resumed_tokens"] += sum(g.num_tokens() for g in keep)
        return keep

    def _stream_partial(self, indices, uids, resumed, timers) -> list:
        """``_stream_and_score`` with partial rollouts: the suspended groups ``resumed`` continue (submitted first,
        so that they take the engine's first slots) beside the new prompts; once the filler is full every group
        still running is suspended (core/partial.py), its tokens and log-probs kept with the version that drew
        them. Stream key k < len(resumed) is resumed[k], the others the new prompts in draw order."""
        s, g, v, r = self.settings, self.settings.group_size, self._version, len(resumed)
        prompt_ids, prompt_mask = self.prompts.collate([sg.index for sg in resumed] + list(indices))
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        base = self._seed()
        seeds = [sg.seed for sg in resumed] + [mix_seed(base, k) % (2 ** 31) for k in range(len(indices))]
        requests = [continuation_requests(sg, prompts[k], s.max_new_tokens) for k, sg in enumerate(resumed)]
        requests += [[(prompts[k], g, s.max_new_tokens, seeds[k])] for k in range(r, r + len(indices))]
        for sg in resumed:
            sg.resumes += 1
        who = [(sg.index, sg.uid) for sg in resumed] + list(zip(indices, uids))
        t0 = time.perf_counter()
        stream = self.generator.stream_requests(requests, temperature=s.temperature, top_p=s.top_p)
        groups, t_scoring = [], 0.0

        def score(k, out):
            group = self._score([who[k][0]], [who[k][1]], prompt_ids[k:k + 1], prompt_mask[k:k + 1], out, timers)
            groups.extend(group)
            self.filler.add_groups(group)

        # Groups that finished while parked (overlap: during the last update) have no request; they enter first.
        done = [k for k in range(r) if not requests[k]]
        scored = set()
        for k, out in itertools.chain(((k, assemble(resumed[k], self.prompts.pad_id)) for k in done), stream):
            scored.add(k)
            t1 = time.perf_counter()
            was_full = self.filler.full()
            if k >= r:
                out = stamp(out, v)
            elif requests[k]:
                out = complete(resumed[k], out, v, self.prompts.pad_id)
            score(k, out)
            t_scoring += time.perf_counter() - t1
            if self.filler.full() and not was_full:
                timers["filled_at"] = time.perf_counter()
                waiting = [j for j in done if j not in scored]  # finished while parked, not handed over yet
                live = _Live(stream, who, seeds, resumed, counted=stream.generated_tokens)
                if self.overlap:  # the engine goes on while the trainer trains; parked before the refit
                    self._suspended += [resumed[j] for j in waiting]
                    self._draw_ahead(live, self._ahead_share(len(who) - len(scored)))
                    self._live.append(live)
                else:
                    for j in waiting:
                        score(j, assemble(resumed[j], self.prompts.pad_id))
                    self._park([live], score)
                break
        timers["gen"] += time.perf_counter() - t0 - t_scoring
        self.counters["generated_tokens"] += stream.generated_tokens
        return groups

    def _stream_rounds(self, indices, uids, resumed, timers) -> list:
        """Partial rollouts in prompt order (``fill_order`` "prompt"): the batch is generated in rounds of at most
        ``round_tokens`` tokens per sample, every round run to its end. Between rounds the groups whose samples have
        all finished are handed to the filler in prompt order (the continued groups first, then the new prompts;
        a group waits for those before it); once the filler is full the rest are suspended as the rounds left them.
        What trains and what is carried over therefore does not depend on the engine's timing; the cost is a
        resubmission (prompt + tokens so far) per round and the wait for each round's last sample.

        Under data parallelism every rank holds the state of every group (one seed for all: rank 0's); a round's
        live groups and the scoring of the finished head are split into contiguous shares, and the ranks exchange
        the results, so the batch is the one a single rank would build from the same engine outputs."""
        prompt_ids, prompt_mask = self.prompts.collate([sg.index for sg in resumed] + list(indices))
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        todo = list(resumed) + self._fresh_groups(indices, uids, self._seed(rank=0))
        groups, handed = [], 0
        while True:
            for group in self._score_head(todo, handed, prompt_ids, prompt_mask, timers):
                handed += 1
                groups.append(group)
                self.filler.add_groups([group])
                if self.filler.full():
                    timers["filled_at"] = time.perf_counter()
                    if self.overlap:  # the engines run one more round while the trainer trains
                        self._round_ahead(todo[handed:])
                    else:
                        self._suspended += todo[handed:]
                    return groups
            live = [k for k in range(handed, len(todo)) if todo[k].unfinished()]
            if not live:
                return groups
            self._reopen(todo, live, self._finish_round(todo, live, self._submit_round(todo, live, prompts), timers))

    def _fresh_groups(self, indices, uids, base: int) -> list:
        """Newly drawn prompts as groups of the prompt-order rounds: no token yet, prompt k seeded from ``base``."""
        g = self.settings.group_size
        return [SuspendedGroup(index=i, uid=u, seed=mix_seed(base, k) % (2 ** 31),
                               samples=[SampleState([], [], []) for _ in range(g)])
                for k, (i, u) in enumerate(zip(indices, uids))]

    def _score_head(self, todo: list, handed: int, prompt_ids, prompt_mask, timers) -> list:
        """The scored groups of the head of the prompt order (``todo[handed:]`` up to the first unfinished one), scored
        in one call per rank. Those behind the group that fills the batch are carried over unscored and scored
        again when the next batch hands them over (the filler's need is known only group by group)."""
        head = handed
        while head < len(todo) and not todo[head].unfinished():
            head += 1
        lo, hi = self._share(head - handed)
        mine, scored = list(range(handed + lo, handed + hi)), []
        if mine:
            out = Generation.cat([assemble(todo[k], self.prompts.pad_id) for k in mine], self.prompts.pad_id)
            scored = self._score([todo[k].index for k in mine], [todo[k].uid for k in mine], prompt_ids[mine],
                                 prompt_mask[mine], out, timers)
        return self._exchange(scored)

    def _submit_round(self, todo: list, live: list, prompts: list) -> tuple:
        """Submit one round of the groups ``live`` (indices into ``todo``): this rank's share, each sample continued
        by at most ``round_tokens`` tokens. Returns what ``_finish_round`` collects (the engines run meanwhile)."""
        s = self.settings
        lo, hi = self._share(len(live))
        mine = live[lo:hi]
        requests = [continuation_requests(todo[k], prompts[k], s.max_new_tokens, self.round_tokens) for k in mine]
        for k in live:  # after the requests: a continuation's seeds follow the resumes before it
            todo[k].resumes += 1
        stream = self.generator.stream_requests(requests, temperature=s.temperature, top_p=s.top_p)
        return mine, self._version, stream

    def _finish_round(self, todo: list, live: list, submitted: tuple, timers) -> list:
        """Wait for a submitted round to end; every rank's states of the groups ``live`` after it (``suspend``,
        stamped with the weight version that was current at the submission), in ``live``'s order."""
        mine, version, stream = submitted
        t0 = time.perf_counter()
        outs = dict(stream)  # the whole round
        timers["gen"] += time.perf_counter() - t0
        s = self.settings
        after = [suspend(outs[key], version, index=todo[k].index, uid=todo[k].uid, seed=todo[k].seed, prior=todo[k],
                         max_new_tokens=s.max_new_tokens) for key, k in enumerate(mine)]
        self.counters["generated_tokens"] += sum(self.reducer.gather_objects(stream.generated_tokens))
        return self._exchange(after)

    def _reopen(self, todo: list, live: list, after: list) -> None:
        for k, one in zip(live, after):
            todo[k] = reopen_round_cuts(todo[k], one, self.settings.max_new_tokens)

    def _round_ahead(self, carried: list) -> None:
        """Overlap in prompt order: the batch is full, and the groups ``carried`` past it plus the prompts the next
        step would draw beside them (``_ahead_share``; drawn now, within ``step``'s sample cap) are submitted as one
        round that runs while the trainer trains. The refit waits for that round's end (``_park_live``), so what it
        generated does not depend on the engines' timing: the next batch continues it as it would any carried-over
        work. A group that the next weights would drop as stale is not continued (it is dropped and counted then)."""
        indices, uids = self._draw_more(self._ahead_share(len(carried)))
        todo = list(carried) + self._fresh_groups(indices, uids, mix_seed(self._seed(rank=0), 1))
        if not todo:  # nothing carried over, and the sample cap lets nothing be drawn: no round
            return
        prompt_ids, prompt_mask = self.prompts.collate([one.index for one in todo])
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        keep, _ = split_stale(todo, self._version + 1, self.max_staleness)
        kept = {id(one) for one in keep}
        live = [k for k, one in enumerate(todo) if one.unfinished() and id(one) in kept]
        self._ahead = (todo, live, self._submit_round(todo, live, prompts)) if live else None
        if not live:
            self._suspended += todo

    def _park_ahead(self, timers) -> None:
        """Overlap in prompt order, before the refit: wait for the round submitted at the full batch; its groups
        join the suspended ones (the carried-over first, then the drawn-ahead prompts, in draw order)."""
        if self._ahead is None:
            return
        (todo, live, submitted), self._ahead = self._ahead, None
        self._reopen(todo, live, self._finish_round(todo, live, submitted, timers))
        self._suspended += todo

    def _exchange(self, mine: list) -> list:
        """Every rank's share of a list, concatenated in rank order (the list itself on one rank)."""
        if self.reducer.world_size == 1:
            return mine
        return [x for part in self.reducer.gather_objects(mine) for x in part]

    def _draw_ahead(self, live: "_Live", n_prompts: int) -> None:
        """Overlap: the next generation batch's prompts, drawn and added to the live stream now (weights of this
        step), so the engine has work while the trainer trains; parked with the rest before the refit. Drawn only
        while ``counters["consumed_samples"]`` stays below ``step``'s ``sample_cap``: the run goes on to use them."""
        s, g = self.settings, self.settings.group_size
        indices, uids = self._draw_more(n_prompts)
        if not indices:
            return
        prompt_ids, prompt_mask = self.prompts.collate(list(indices))
        base = mix_seed(self._seed(), 1)
        seeds = [mix_seed(base, k) % (2 ** 31) for k in range(len(indices))]
        requests = [[(row[m.bool()].tolist(), g, s.max_new_tokens, seeds[k])]
                    for k, (row, m) in enumerate(zip(prompt_ids, prompt_mask))]
        self.generator.stream_requests(requests, temperature=s.temperature, top_p=s.top_p, into=live.stream,
                                       first_key=len(live.who))
        live.who += list(zip(indices, uids))
        live.seeds += seeds

    def _ahead_share(self, carried: int) -> int:
        """How many prompts the overlap draws ahead: those the next step would draw beside the ``carried`` groups it
        continues anyway. Drawing a whole batch beside them made every later batch larger than the filler asks, and
        its tail waited a step more (trained two versions late, or dropped as stale)."""
        return max(self.filler.next_step_gen_batch_size() - carried, 0)

    def _draw_more(self, n_prompts: int) -> tuple:
        """Overlap: ``n_prompts`` of the next batch's prompts drawn now, if the next step runs: while
        ``counters["consumed_samples"]`` is below ``step``'s ``sample_cap``. They count as consumed when that step
        begins (``_count_ahead``), so a sample budget stops the run where it stops the synchronous loop."""
        if n_prompts <= 0 or (self._sample_cap is not None and self.counters["consumed_samples"] >= self._sample_cap):
            return [], []
        skipped_before = self.sampler.skipped
        indices, uids = self.sampler.draw(n_prompts)
        self.counters["skipped_prompts"] += self.sampler.skipped - skipped_before
        self._drawn_ahead += n_prompts
        return list(indices), list(uids)

    def _count_ahead(self) -> None:
        """A step begins: the prompts drawn ahead for it count as consumed now."""
        self.counters["consumed_prompts"] += self._drawn_ahead
        self.counters["consumed_samples"] += self._drawn_ahead * self.settings.group_size
        self._drawn_ahead = 0

    def _park(self, live: list, score=None) -> None:
        """Suspend every live stream (core/partial.py): each group keeps its tokens and log-probs with the version
        that drew them. ``score``: hand a group whose samples have all finished to the filler now (inside a
        generation batch); None (overlap, before the refit): keep it with the suspended ones, for the next batch."""
        s, v = self.settings, self._version
        for one in live:
            r = len(one.resumed)
            for j, part in sorted(one.stream.suspend().items()):
                sg = suspend(part, v, index=one.who[j][0], uid=one.who[j][1], seed=one.seeds[j],
                             prior=one.resumed[j] if j < r else None, max_new_tokens=s.max_new_tokens)
                if sg.unfinished() or score is None:
                    self._suspended.append(sg)
                else:  # its last samples finished while the stream stopped: a carried-over group like others
                    score(j, assemble(sg, self.prompts.pad_id))

    def _park_live(self, timers=None) -> None:
        """Overlap, before the refit (and before a step returns): park what ran on during the update (in prompt
        order: wait for the round's end; ``timers["gen"]`` counts the wait)."""
        self._park_ahead(dict(gen=0.0) if timers is None else timers)
        live, self._live = self._live, []
        self._park(live)
        self.counters["generated_tokens"] += sum(one.stream.generated_tokens - one.counted for one in live)

    def _partial_metrics(self) -> dict:
        """partial/*: the suspended work held now, what was continued / dropped as stale (cumulative), and the share
        of all generated tokens never trained because an abort or the staleness bound threw them away."""
        c, p = self.counters, self.partial_counters
        out = {f"partial/{k}": float(v) for k, v in p.items()}
        out["partial/weight_version"] = float(self._version)
        out["partial/suspended_groups"] = float(len(self._suspended))
        out["partial/suspended_tokens"] = float(sum(g.num_tokens() for g in self._suspended))
        wasted = c["aborted_tokens"] + p["stale_tokens"]
        out["partial/discarded_token_frac"] = wasted / c["generated_tokens"] if c["generated_tokens"] else 0.0
        return out
