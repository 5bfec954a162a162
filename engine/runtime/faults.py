"""A test-only fault hook: make one stage of the engine raise for chosen requests, to prove that a failure inside a
step ends that request alone (an error finish) and never the engine loop.

Inert unless the environment variable REDRAFT_FAULT_INJECT is set when the engine starts (read once):

    REDRAFT_FAULT_INJECT=STAGE:RID_SUBSTRING[,STAGE:RID_SUBSTRING...]

raises InjectedFault in STAGE for every request whose rid contains RID_SUBSTRING (an empty substring matches every
request; for the "score" stage it is matched against the likelihood job's token, so use an empty one). Stages:
admit (EngineCore.add_request), pre_forward (the scheduler's per-request check), begin_block (structured output's
block start), controls (logit controls), sweep (structured output's sweep), forward (the batch forward: the
engine must find the culprit), output (building a request's message), score (one chunk of a likelihood job).
Never set it in production.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("redraft.faults")

ENV = "REDRAFT_FAULT_INJECT"
STAGES = ("admit", "pre_forward", "begin_block", "controls", "sweep", "forward", "output", "score")


class InjectedFault(RuntimeError):
    """The failure REDRAFT_FAULT_INJECT asked for."""


class FaultInjector:
    def __init__(self, rules: list[tuple[str, str]]):
        self.rules = rules

    def __call__(self, stage: str, rid: str) -> None:
        self.check(stage, rid)

    @classmethod
    def from_env(cls) -> "FaultInjector":
        spec = os.environ.get(ENV, "")
        rules = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            stage, _, sub = part.partition(":")
            if stage not in STAGES:
                raise ValueError(f"{ENV}: unknown stage {stage!r} (one of {', '.join(STAGES)})")
            rules.append((stage, sub))
        if rules:
            log.warning("%s is set: injecting failures %s (a test hook; never in production)", ENV, rules)
        return cls(rules)

    def check(self, stage: str, rid: str) -> None:
        """Raise InjectedFault if a rule names this stage and this rid."""
        for s, sub in self.rules:
            if s == stage and sub in rid:
                raise InjectedFault(f"injected fault in {stage} for {rid}")

    def check_any(self, stage: str, rids: list[str]) -> None:
        for rid in rids:
            self.check(stage, rid)


NO_FAULTS = FaultInjector([])

Failures = dict[str, tuple[str, BaseException]]  # rid -> (stage, exception): the requests a step ends alone


def guard(faults: FaultInjector, failed: Failures, rid: str, stage: str, fn, *args) -> None:
    """One request's share of a stage of the step; an exception is recorded as that request's failure (EngineCore
    logs it and ends that request with an error finish) instead of ending the batch."""
    try:
        faults.check(stage, rid)
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - ends this request only
        failed[rid] = (stage, exc)
