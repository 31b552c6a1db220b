"""Errors shared by the command line and the library (no torch import, so `torchtsp --help` stays fast)."""


class RankFailedError(RuntimeError):
    """A rank raised (``rank``, its ``traceback``), died, or did not answer in time."""

    def __init__(self, message: str, rank: int | None = None, traceback_text: str = ""):
        super().__init__(message + (f"\n{traceback_text}" if traceback_text else ""))
        self.rank, self.traceback = rank, traceback_text
        lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else ""
        for plain in ("ValueError: ", "FileNotFoundError: ", "OSError: "):  # torchtsp's one-line errors
            last = last.removeprefix(plain)
        self.summary = f"rank {rank}: {last}" if lines else message


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, not an error
    """The launcher was asked to stop twice (``signum``: the signal): abort without waiting for the ranks."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum
