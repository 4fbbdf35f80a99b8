"""An islands job's checkpoints: one orbax manager per island, and the steps that
count (those every island holds)."""

from __future__ import annotations

from hetjax import checkpoint


class Checkpoints:
    """One orbax manager per island (run_dir/checkpoints/<island>). A step counts only
    when every island has it: restore picks the newest step all islands can read."""

    def __init__(self, job):
        self.job = job
        self.directory = checkpoint.default_dir(job.cfg)

    def should_save(self, step: int) -> bool:
        return self.job.workers[0].manager.should_save(step)

    def save(self, step: int, states, data_state: dict, config: dict) -> None:
        # One island after the other: orbax numbers a process's save operations in one
        # global counter, and two saves started at once from two threads (virtual
        # islands) mix up each other's temporary directories. The saves stay asynchronous.
        for w, state in zip(self.job.workers, states):
            w.manager.save(step, state, data_state, config)

    def wait(self) -> None:
        for w in self.job.workers:
            w.manager.wait()

    def steps(self) -> list[int]:
        return sorted(set.intersection(*(set(w.manager.steps()) for w in self.job.workers)))

    def close(self) -> None:
        for w in self.job.workers:
            w.manager.close()

    def restore_latest(self, abstract_states: list, shardings: list, log=print) -> checkpoint.Restored | None:
        """The newest step every island (also the ones in other processes) holds and can
        read, as a Restored whose state is the local islands' states (laid out by
        `shardings`, one per local island); None if there is none."""
        job = self.job
        while True:
            held = {w.name: w.manager.steps() for w in job.workers}
            common, everyone = job.agree_steps(sorted(self.steps()), any(held.values()))
            if not common:
                if everyone:
                    raise checkpoint.CheckpointError(
                        f"the islands hold checkpoints but no step in common ({held} here); a job "
                        f"resumes all islands at one step, and starting again from step 0 would "
                        f"overwrite them: keep them, and restore a common step or move them away")
                return None
            step = common[-1]
            for w in job.workers:  # a newer step that not every island holds was never finished
                for newer in [s for s in w.manager.steps() if s > step]:
                    w.manager.move_aside(newer, log, why="unfinished (not every island saved it)")
            try:
                restored = [w.manager.restore(step, a, s)  # as saved
                            for w, a, s in zip(job.workers, abstract_states, shardings, strict=True)]
                ok = 1
            except checkpoint.CorruptCheckpoint as e:
                log(f"warning: {e}")
                ok = 0
            if job.all_ok(ok, f"restore{step}"):
                return checkpoint.Restored(step, [r.state for r in restored], restored[0].data_state,
                                           restored[0].meta)
            for w in job.workers:  # someone could not read it: set it aside everywhere
                if step in w.manager.steps():
                    w.manager.move_aside(step, log)
