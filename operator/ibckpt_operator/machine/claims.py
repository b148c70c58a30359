"""Which job holds which pods: two jobs never touch the same pod at once.

In the operator's memory, all-or-nothing per job. It is not stored anywhere of its own: after a restart the
operator rebuilds it from the jobs' statuses (`from_jobs`), where each claim is recorded.
"""

from __future__ import annotations

from collections.abc import Iterable

from ibckpt_operator.machine.checkpoint import JobState


class PodClaims:
    def __init__(self) -> None:
        self._holder: dict[str, str] = {}

    def claim(self, job: str, pods: Iterable[str]) -> str | None:
        """Claim every pod (by UID) for `job`, or none: returns the job that holds one, else None."""
        wanted = list(pods)
        for pod in wanted:
            holder = self._holder.get(pod)
            if holder is not None and holder != job:
                return holder
        for pod in wanted:
            self._holder[pod] = job
        return None

    def release(self, job: str) -> None:
        self._holder = {pod: holder for pod, holder in self._holder.items() if holder != job}

    def holder(self, pod: str) -> str | None:
        return self._holder.get(pod)

    @classmethod
    def from_jobs(cls, jobs: Iterable[tuple[str, JobState]]) -> PodClaims:
        claims = cls()
        for job, state in jobs:
            if state.claimed:
                claims.claim(job, (member.pod.uid for member in state.members))
        return claims
