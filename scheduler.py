"""
The engine's thread: requests that overlap in time decode together. Each request is a Job (a Row of the engine's
batch) whose client reads its events; the Scheduler admits waiting jobs into the batch and decodes it.
"""
import queue
import threading
import traceback
from contextlib import nullcontext

from engine import Engine, Row, Sampling, TextStream

MAX_WAITING = 64  # jobs queued for a row beyond this are refused: a client should back off rather than time out


class QueueFull(Exception):
    """Scheduler.submit found MAX_WAITING jobs already waiting for a row."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} jobs are waiting")
        self.waiting = waiting


class Job(Row):
    """One request's row in the engine. Its client reads `events` (a queue, or anything with put()): (text, None)
    as the answer grows, then (text, finish_reason); ("", "error") when generation failed. Setting `cancelled`
    takes it out of the batch."""

    def __init__(self, prompt: list[int], max_new: int, sampling: Sampling, eos_id: int, text: TextStream,
                 events=None):
        super().__init__(prompt, max_new, sampling, eos_id)
        self.text = text
        self.events = queue.SimpleQueue() if events is None else events
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled

    def append(self, token: int):
        """Record the next token and tell the client what it adds; a stop string ends the row."""
        super().append(token)
        if token == self.eos_id:
            self.events.put((self.text.finish(), "stop"))
            return
        new = self.text.add(token)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif self.finish_reason == "length":
            new += self.text.finish()
        self.events.put((new, self.finish_reason))

    def fail(self, error: Exception):
        super().fail(error)
        traceback.print_exception(error)
        self.events.put(("", "error"))


class Scheduler:
    """The engine's thread. Each round it admits the waiting jobs there is room for (each prefilled alone: one
    prompt length), decodes one token for every row of the batch, and lets the rows that are done, or whose
    client left, go."""

    def __init__(self, model, max_batch: int, autocast=nullcontext):
        self.engine, self.autocast = Engine(model, max_batch), autocast
        self.waiting: queue.Queue = queue.Queue()
        self.generated = 0  # tokens generated since the start

    def start(self):
        threading.Thread(target=self.loop, name="engine", daemon=True).start()

    def submit(self, job: Job):
        """Queue job for a row; QueueFull if MAX_WAITING jobs are waiting already."""
        if self.waiting.qsize() >= MAX_WAITING:
            raise QueueFull(MAX_WAITING)
        self.waiting.put(job)

    def load(self) -> dict:
        """{running, waiting, generated_tokens}: the rows decoding, the jobs queued, the tokens since the start."""
        return {"running": len(self.engine.rows), "waiting": self.waiting.qsize(), "generated_tokens": self.generated}

    def loop(self):
        while True:
            try:
                with self.autocast():
                    self.step()
            except Exception as e:  # a bug: fail the jobs in flight, keep serving the next ones
                traceback.print_exc()
                for job in self.engine.rows:
                    job.fail(e)
                self.engine.rows = []

    def step(self):
        while len(self.engine.rows) < self.engine.max_batch:
            try:
                job = self.waiting.get(block=not self.engine.rows)  # idle: sleep until a request comes
            except queue.Empty:
                break
            if not job.cancelled:
                self.engine.add([job])
                self.generated += 1
        self.engine.drop_done()  # the jobs cancelled meanwhile
        self.generated += len(self.engine.rows)
        self.engine.step()

