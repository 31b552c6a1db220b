"""Chat templates, rendered in a separate process with a bound on time, output and memory.

Chat templates are the Hugging Face convention: jinja2 source in ``tokenizer_config.json``'s
``chat_template`` (or ``chat_template.jinja``), rendered with ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``, in jinja2's immutable sandbox (a template is data from the checkpoint: it
may not touch Python objects).

The sandbox stops escapes, not work: two nested ``range(100000)`` loops, ``"x" * 10**9`` or ``9**9**9``
would hold the CPU or the memory for as long as they like, and a Python thread cannot be stopped. So a
template renders in a child process (``python -m torchtsp.serve.template``, a few of them reused, fed JSON
over pipes): past ``timeout_s`` the child is killed, so the work really stops; its output is cut at
``max_chars`` and its address space limited. The request fails with a 400 naming the bound, and the
next render starts a fresh child.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from multiprocessing.connection import Connection
from pathlib import Path

RENDER_TIMEOUT_S = 5.0  # a real template renders in milliseconds
MAX_RENDER_CHARS = 1 << 22  # 4 Mi characters: far more than any context holds
RENDER_MEMORY_BYTES = 1 << 30  # address space a child may add to what it holds when ready
RENDERERS = 2  # children rendering at once
START_TIMEOUT_S = 60.0  # a child's start (imports jinja2) on a loaded machine


MAX_POWER_EXPONENT = 4096  # 9**9**9 would hold the CPU without a single bytecode boundary
# (text rendered so far, spans found) while a render tracks its {% generation %} blocks; None otherwise.
_GENERATION_TRACKING: ContextVar = ContextVar("generation_tracking", default=None)
# How transformers tells that a template marks the assistant's text (return_assistant_tokens_mask).
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


def _generation_markers():
    """``{% generation %}...{% endgeneration %}``, as transformers' AssistantTracker: the block renders its body
    unchanged and, while a render tracks it, records the character span the body takes in the output."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationMarkers(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            tracking = _GENERATION_TRACKING.get()
            if tracking is not None:  # the output so far is what the render loop has collected
                parts, spans = tracking
                start = sum(map(len, parts))
                spans.append((start, start + len(text)))
            return text

    return GenerationMarkers


def _environment():
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        # Intercepted operators are not folded into constants when the template compiles, so
        # {{ 'x' * 10**10 }} cannot run before any bound applies; at render time they are bounded here.
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > MAX_POWER_EXPONENT:
                raise SecurityError(f"an exponent of {right} is past the bound of {MAX_POWER_EXPONENT}")
            if operator == "*":
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * times > MAX_RENDER_CHARS:
                    raise SecurityError(f"a repetition of {len(seq) * times} items is past the bound of "
                                        f"{MAX_RENDER_CHARS} characters")
            return super().call_binop(context, operator, left, right)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # As transformers renders chat templates (the convention they are written for): keys in their order and
        # no HTML escaping; jinja2's own filter sorts keys, which reorders every tool's schema in the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # loopcontrols ({% break %}, {% continue %}) and the generation markers: the extensions transformers enables.
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_generation_markers(), "jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env


def check_syntax(source: str) -> None:
    """A template that does not parse is refused when the server starts (parsing only: compiling evaluates
    constant parts, which is work for the bounded child)."""
    from jinja2 import TemplateError

    try:
        _environment().parse(source)
    except TemplateError as e:
        raise ValueError(f"the chat template does not parse: {' '.join(str(e).split())}") from None


def render_bounded(template, context: dict, max_chars: int, generation_spans: list | None = None) -> tuple[str, str]:
    """("ok", text) or ("error", why) -- in the child; stops as soon as the output passes ``max_chars``. Given a
    list, ``generation_spans`` receives the (start, end) character span of each ``{% generation %}`` block."""
    from jinja2 import TemplateError

    parts, size = [], 0
    tracking = _GENERATION_TRACKING.set(None if generation_spans is None else (parts, generation_spans))
    try:
        for part in template.generate(**context):
            size += len(part)
            if size > max_chars:
                return "error", f"the chat template's output passed {max_chars} characters on these messages"
            parts.append(part)
    except TemplateError as e:
        return "error", f"the chat template refused these messages: {e}"
    except MemoryError:
        return "error", "the chat template ran out of memory on these messages"
    except Exception as e:  # noqa: BLE001 - a template's TypeError etc.: the request's fault, one line
        return "error", f"the chat template failed on these messages: {type(e).__name__}: {e}"
    finally:
        _GENERATION_TRACKING.reset(tracking)
    return "ok", "".join(parts)


def _limit_memory(extra: int) -> None:
    try:
        import resource

        held = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = held + extra
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard < 0 else min(limit, hard), hard))
    except (ImportError, OSError, ValueError):  # not Linux: time and output stay bounded
        pass


def _child() -> None:
    """The render loop of a child: a setup message, then one request per message until stdin closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when its children stop
    requests, answers = Connection(os.dup(0), writable=False), Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # anything printed goes to the server's log, not into the answers
    setup = json.loads(requests.recv_bytes())
    env = _environment()
    _limit_memory(setup["memory_bytes"])
    answers.send_bytes(b'"started"')
    try:
        template, failed = env.from_string(setup["source"]), None
    except Exception as e:  # noqa: BLE001 - reported with each request
        template, failed = None, f"the chat template does not compile: {type(e).__name__}: {e}"
    answers.send_bytes(b'"ready"')
    while True:
        try:
            context = json.loads(requests.recv_bytes())
        except EOFError:
            return
        context.update(bos_token=setup["bos_token"], eos_token=setup["eos_token"])
        answer = ("error", failed) if failed else render_bounded(template, context, setup["max_chars"])
        answers.send_bytes(json.dumps(answer).encode())


class InlineChatTemplate:
    """A chat template rendered in this process, as transformers' ``apply_chat_template`` renders it (``messages``,
    ``tools``, ``documents`` = None, ``add_generation_prompt`` and the tokenizer's named special tokens), in the same
    bounded sandbox as the served one but with no bound on time: for ``prepare-data``, whose user can stop it, and
    which renders every conversation several times (a child process per render would cost more than the render).
    A template that fails is a ValueError naming its message."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        check_syntax(source)
        try:
            self._template = _environment().from_string(source)
        except Exception as e:  # noqa: BLE001 - jinja2 raises several kinds for a template it cannot compile
            raise ValueError(f"the chat template does not compile: {type(e).__name__}: {e}") from None
        self.special_tokens = dict(special_tokens)
        self.marks_generation = bool(GENERATION_TAG.search(source))  # as transformers tells

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False,
               generation_spans: list | None = None) -> str:
        context = {**self.special_tokens, "messages": messages, "tools": tools, "documents": None,
                   "add_generation_prompt": add_generation_prompt}
        status, text = render_bounded(self._template, context, MAX_RENDER_CHARS, generation_spans)
        if status != "ok":
            raise ValueError(" ".join(text.split())[:1000])
        return text


class _Renderer:
    """One child process and its two pipes."""

    def __init__(self, setup: bytes):
        package_root = str(Path(__file__).resolve().parents[2])  # so that the child imports this torchtsp
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                           if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "torchtsp.serve.template"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.send = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.recv = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.send.send_bytes(setup)
        self.compiled = False
        if not self.recv.poll(START_TIMEOUT_S) or json.loads(self.recv.recv_bytes()) != "started":
            self.kill()
            raise OSError("the chat template's renderer process did not start")

    def wait_compiled(self, timeout_s: float) -> bool:
        """Whether the child compiled the template (or found it does not compile) within ``timeout_s``."""
        if not self.compiled and self.recv.poll(timeout_s) and json.loads(self.recv.recv_bytes()) == "ready":
            self.compiled = True
        return self.compiled

    def ask(self, context: bytes, timeout_s: float) -> tuple[str, str] | None:
        """The child's answer, or None when it took longer than ``timeout_s`` (compiling, then rendering)."""
        if not self.wait_compiled(timeout_s):
            return None
        self.send.send_bytes(context)
        if not self.recv.poll(timeout_s):
            return None
        return tuple(json.loads(self.recv.recv_bytes()))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.recv.close()


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None, *,
                 timeout_s: float = RENDER_TIMEOUT_S, max_chars: int = MAX_RENDER_CHARS, processes: int = RENDERERS):
        check_syntax(source)
        self.source = source  # served as is by /tokenizer_info
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self._setup = json.dumps({"source": source, "bos_token": bos_token or "", "eos_token": eos_token or "",
                                  "max_chars": max_chars, "memory_bytes": RENDER_MEMORY_BYTES}).encode()
        self._idle: queue.Queue = queue.Queue()
        self._free = threading.Semaphore(processes)  # children busy or idle, at most ``processes``
        self._executor = ThreadPoolExecutor(processes, thread_name_prefix="torchtsp-template")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               variables: dict | None = None) -> str:
        """The rendered text (blocking); APIError 400 when the template refuses, fails or passes a bound. ``tools``:
        the request's tools, given to the template as transformers' ``apply_chat_template`` gives them;
        ``variables``: more of the template's variables (a request's chat_template_kwargs, as vLLM passes them)."""
        from .protocol import APIError

        context = {**(variables or {}), "messages": messages, "add_generation_prompt": add_generation_prompt}
        context = json.dumps(context if tools is None else {**context, "tools": tools}).encode()
        with self._free:
            renderer = self._take()
            try:
                answer = renderer.ask(context, self.timeout_s)
            except (OSError, EOFError, ValueError):  # the child died (its memory limit, the OOM killer)
                renderer.kill()
                raise APIError(400, "the chat template's renderer died on these messages", "messages",
                               "chat_template_error") from None
            if answer is None:
                renderer.kill()  # the only way to stop a runaway render
                raise APIError(400, f"the chat template took longer than {self.timeout_s:g} s on these messages "
                                    f"and was stopped", "messages", "chat_template_timeout")
            self._idle.put(renderer)
        if answer[0] != "ok":
            raise APIError(400, answer[1][:1000], "messages", "chat_template_error")
        return answer[1]

    async def render_async(self, messages: list[dict], add_generation_prompt: bool = True,
                           tools: list | None = None, variables: dict | None = None) -> str:
        """``render`` off the event loop, on threads of its own (a burst of slow templates leaves the default
        executor, which tokenizes, free)."""
        import asyncio

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.render, messages, add_generation_prompt, tools,
                                          variables)

    def _take(self) -> _Renderer:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            return _Renderer(self._setup)

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().kill()


if __name__ == "__main__":
    _child()
