"""What this daemon's specs in the CDI dir are, and why some are not there (no I/O here).

The CDI sync (:mod:`devplug.cdi.sync`) decides a pass and has it carried out
(:mod:`devplug.cdi.carry_out`); each job's outcome then comes here, once, whatever ended the
pass: it is logged, counted for stats and metrics, and handed to the catalog Allocate reads.
The sync reads the ledger back to plan the next pass, to retry failures and to clean up at
shutdown.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import replace
from pathlib import Path

import structlog

from devplug._kits.problems import ProblemLog, error_reason
from devplug.cdi.catalog import CdiCatalog, CdiResource
from devplug.cdi.plan import Outcome, Plan, WrittenSpec
from devplug.cdi.store import SpecHeldError

# The sync's logger: the events below were always its own.
log = structlog.get_logger("devplug.cdi")


class SpecLedger:
    """resource -> the spec this daemon has on disk, the reason it has none, or the daemon
    that serves it instead; with the counts of writes and failures."""

    def __init__(self, directory: Path, catalog: CdiCatalog) -> None:
        self.directory = directory
        self.catalog = catalog
        self.written: dict[str, WrittenSpec] = {}
        self.failing = ProblemLog()  # resource -> the reason of its last failure
        # resource -> the owner token of the running daemon that serves its spec
        self.held: dict[str, str] = {}
        self.writes = 0  # counters for stats and metrics
        self.failures = 0

    def forget(self, resource: str) -> None:
        """No spec of ``resource`` on disk is this daemon's now: Allocate names none."""
        self.written.pop(resource, None)
        self.catalog.set(resource, None)

    def drop_gone(self, advertised: Container[str]) -> None:
        """Forget the failures and holders of resources no longer ``advertised``; a resource
        whose spec this daemon wrote keeps its failure until the spec's removal is done."""
        for key in self.failing.unsolved():
            if key not in advertised and key not in self.written:
                self.failing.solved(key)  # gone before its spec was ever written
        for resource in [r for r in self.held if r not in advertised]:
            del self.held[resource]

    def record(
        self,
        plan: Plan,
        outcomes: Mapping[str, Outcome],
        before: Mapping[str, CdiResource | None],
    ) -> None:
        """Take in what came of ``plan``'s jobs; ``before``: the catalog's entries as they
        were when the pass began (what a failed write leaves on disk)."""
        for resource, outcome in outcomes.items():
            if not isinstance(outcome, SpecHeldError):
                self.held.pop(resource, None)
            if isinstance(outcome, Exception):
                self._record_failure(resource, outcome, before)
                continue
            if resource in plan.remove:
                self.forget(resource)
                log.info("cdi.spec.removed", resource=resource, reason="resource gone")
                self.failing.solved(resource)
                continue
            if outcome is None:
                continue  # unreachable: None is only a removal's outcome
            if resource in plan.verify:
                done = self.written[resource]
                if outcome.wrote:  # it had gone or been replaced: rewritten
                    self.writes += 1
                    log.warning("cdi.spec.rewritten", resource=resource, reason="changed on disk")
                done.stamp = outcome.stamp
                done.entry = replace(done.entry, stamp=outcome.stamp)
                self.catalog.set(resource, done.entry)  # back, if Allocate had dropped it
                continue
            job = plan.write[resource]
            if outcome.entry is None:
                self.forget(resource)
            else:
                entry = replace(
                    outcome.entry, path=self.directory / job.file_name, stamp=outcome.stamp
                )
                self.written[resource] = WrittenSpec(
                    job.devices, outcome.data, entry, outcome.stamp
                )
                self.catalog.set(resource, entry)
            if outcome.wrote:
                self.writes += 1
                log.info("cdi.spec.written", resource=resource, file=job.file_name)
            if self.failing.solved(resource):
                log.info("cdi.spec.recovered", resource=resource)

    def _record_failure(
        self, resource: str, error: Exception, before: Mapping[str, CdiResource | None]
    ) -> None:
        self.failures += 1
        reason = error_reason(error)
        if isinstance(error, SpecHeldError):
            self.held[resource] = error.owner
            # Another running daemon serves this spec (a second `devplug run` on the same
            # dirs, say): leave it to that one; the dir watch says when it lets go.
            self.forget(resource)
            self.failing.report(
                log,
                "cdi.spec.held_elsewhere",
                reason,
                key=resource,
                level="warning",
                resource=resource,
                dir=str(self.directory),
                held_by=error.instance,
                retry="when that daemon lets go; Allocate gives device specs meanwhile",
            )
            return
        self.failing.report(
            log,
            "cdi.spec.write_failed",
            reason,
            key=resource,
            level="warning",
            resource=resource,
            dir=str(self.directory),
            retry="with back-off; Allocate gives device specs meanwhile",
        )
        if resource in before:
            self.catalog.set(resource, before[resource])  # the old file is still there
