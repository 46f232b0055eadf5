"""An API node's configuration (:class:`ApiConfig`), apart from its handlers: the model it serves
and how (its names, context, chat template, sampling defaults, parsers, adapters), who may call
it, where it listens, what it logs, and its place on the control plane.

What the settings leave to the model dir is filled in as the node starts
(:func:`fd.compose.start_api`): the context (``max_model_len`` None: the model's), and the
sampling defaults and output cap of ``--generation-config``. A request is checked against the
config's :meth:`ApiConfig.limits`.

A field that is a command-line flag of ``fd serve`` / ``fd api`` says so in its metadata
(``flag``, ``help``, and argparse's keywords; ``type`` by name, from fd/cli/flags.py's
``NAMED_TYPES``), which fd's CLI builds the flag from, so its default and help are written here
alone.
"""

from __future__ import annotations

import ssl
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fd.api.cors import Cors
from fd.api.reasoning import PARSERS as REASONING_PARSERS
from fd.api.tool_calls import PARSERS as TOOL_PARSERS
from fd.api.validation import DEFAULT_MAX_TOKENS, MAX_BODY_BYTES, Limits
from fd.control.bus import REQUEST_TTL_S


def new_api_id() -> str:
    return f"api-{uuid.uuid4().hex[:8]}"


@dataclass(kw_only=True)
class ApiConfig:
    """Everything an API node is configured with. ``fd serve`` and ``fd api`` make one of their
    flags (fd/cli/serving.py); :func:`fd.compose.start_api` starts a node of it. Built by
    keyword: its fields are many, and several of one type."""

    # --- the model, as requests see it
    model_dir: str
    # the name(s) requests use (vLLM's --served-model-name: the first is the one answers
    # give); None: the model dir's name
    served_model_name: str | list[str] | None = field(
        default=None,
        metadata={
            "flag": "--served-model-name",
            "nargs": "+",
            "help": "the model name(s) requests use (default: the model dir's name); "
            "answers give the first, as vLLM's",
        },
    )
    # prompt + output; None: the model's own (start_api fills it in). Its flag is the engines'
    # (fd.engine.node.node_config.SchedulerSettings): the API and the engines must agree.
    max_model_len: int | None = None
    # vLLM's --chat-template: a Jinja file, or the template itself; None: the model's own
    chat_template: str | None = field(
        default=None,
        metadata={
            "flag": "--chat-template",
            "help": "a Jinja chat template file, or the template itself, instead of the model's (as vLLM's)",
        },
    )
    # vLLM's --generation-config: "auto" (the model dir's generation_config.json), "vllm"
    # (none: fd's own defaults), or another dir holding one
    generation_config: str = field(
        default="auto",
        metadata={
            "flag": "--generation-config",
            "help": "auto: a request that leaves out temperature, top_p, top_k, min_p or "
            "repetition_penalty gets the model's generation_config.json value, and "
            "its max_new_tokens caps every output (vLLM's default); vllm: fd's own "
            "defaults; or a dir with another generation_config.json",
        },
    )
    # Sampling defaults for requests that leave them out, and a cap on every output: start_api
    # adds --generation-config's where these say nothing.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_output_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # completions; chat: the rest of the context
    max_body_bytes: int = MAX_BODY_BYTES
    # vLLM's --enable-auto-tool-choice --tool-call-parser NAME (fd.api.tool_calls)
    tool_parser: str | None = field(
        default=None,
        metadata={
            "flag": "--tool-call-parser",
            "choices": TOOL_PARSERS,
            "help": "how the model writes a tool call: hermes = <tool_call>{json}</tool_call> "
            "(Qwen 2.5/3, Hermes); llama3_json = an answer that is {json}; {json} "
            "(Llama 3.1-3.3)",
        },
    )
    reasoning_parser: str | None = field(  # see fd.api.reasoning
        default=None,
        metadata={
            "flag": "--reasoning-parser",
            "choices": REASONING_PARSERS,
            "help": "show a reasoning model's <think>...</think> as reasoning_content in "
            "chat responses: deepseek_r1 (R1, QwQ, Qwen3 2507 thinking: the output "
            "thinks until </think>) or qwen3 (Qwen3 hybrid: only an output that "
            "begins with <think>)",
        },
    )
    force_include_usage: bool = field(  # vLLM's
        default=False,
        metadata={
            "flag": "--enable-force-include-usage",
            "action": "store_true",
            "help": "every stream ends with its usage chunk, asked for or not",
        },
    )
    tokens_as_ids: bool = field(  # vLLM's
        default=False,
        metadata={
            "flag": "--return-tokens-as-token-ids",
            "action": "store_true",
            "help": 'log-probabilities name their tokens "token_id:<id>" unless a request says otherwise',
        },
    )
    priority_scheduling: bool = False  # --scheduling-policy priority: requests may carry a priority
    lora_modules: dict[str, str] = field(default_factory=dict)  # vLLM's --lora-modules: name -> path
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    runtime_lora: bool = False
    # --- who may call it
    api_key: str | Sequence[str] | None = None  # one key, or several (each a tenant: fd.api.tenancy)
    admin_key: str | None = None
    cors: Cors | None = field(default_factory=Cors)  # vLLM's --allowed-origins etc.; None: no CORS
    # --- where it listens
    host: str = field(
        default="127.0.0.1",
        metadata={"flag": "--host", "help": "the address the API listens on (0.0.0.0: every one)"},
    )
    port: int = field(default=0, metadata={"flag": "--port", "help": "the API's TCP port (0: a free one)"})
    reuse_port: bool = False  # several API processes on one port (fd serve --api-server-count)
    # a client that opens a connection, or starts a request on a kept-alive one, and does not
    # finish the request's head in time is cut off (slowloris: fd.api.server.ApiProtocol)
    header_timeout_s: float = field(
        default=20.0,
        metadata={
            "flag": "--header-timeout",
            "type": "timeout_s",
            "metavar": "S",
            "help": "seconds a client has to send a request's head (line and headers), from "
            "its connection's start or the head's first byte; else the connection is "
            "closed (default %(default)s; 0: no limit)",
        },
    )
    # HTTPS as vLLM serves it (its uvicorn's settings): a key and a certificate chain, and for
    # client certificates the CAs and whether one is required
    ssl_keyfile: str | None = field(
        default=None, metadata={"flag": "--ssl-keyfile", "metavar": "FILE", "help": "HTTPS: the key"}
    )
    ssl_certfile: str | None = field(
        default=None,
        metadata={"flag": "--ssl-certfile", "metavar": "FILE", "help": "HTTPS: the certificate chain"},
    )
    ssl_ca_certs: str | None = field(
        default=None,
        metadata={
            "flag": "--ssl-ca-certs",
            "metavar": "FILE",
            "help": "HTTPS: the CAs of client certificates",
        },
    )
    ssl_cert_reqs: int = field(
        default=0,
        metadata={
            "flag": "--ssl-cert-reqs",
            "choices": (0, 1, 2),
            "help": "HTTPS: client certificates 0 not asked for, 1 checked if given, 2 required "
            "(Python's ssl.CERT_*, as vLLM's)",
        },
    )
    ssl_ciphers: str | None = field(
        default=None, metadata={"flag": "--ssl-ciphers", "help": "HTTPS: the ciphers (OpenSSL's list)"}
    )
    # --- what it logs
    # an access line per HTTP request (fd.api.server's, uvicorn's in vLLM): on by default
    disable_uvicorn_access_log: bool = field(
        default=False,
        metadata={
            "flag": "--disable-uvicorn-access-log",
            "action": "store_true",
            "help": "no access line per HTTP request (vLLM's name for it)",
        },
    )
    disable_access_log_for_endpoints: tuple[str, ...] = field(
        default=(),
        metadata={
            "flag": "--disable-access-log-for-endpoints",
            "type": "endpoint_list",
            "metavar": "PATHS",
            "help": "paths whose requests get no access line, comma-separated (vLLM's; "
            "e.g. /health,/metrics)",
        },
    )
    # vLLM's --enable-log-requests: a line for each generating request with its prompt and
    # sampling parameters (off by default: prompts are the users' data); --max-log-len: at most
    # this many characters and token ids of the prompt in it
    log_requests: bool = field(
        default=False,
        metadata={
            "flag": "--enable-log-requests",
            "action": "store_true",
            "help": "a log line for each generating request with its prompt and sampling "
            "parameters (vLLM's; off: prompts are the users' data)",
        },
    )
    max_log_len: int | None = field(
        default=None,
        metadata={
            "flag": "--max-log-len",
            "metavar": "N",
            "help": "at most N characters and token ids of a prompt in --enable-log-requests' "
            "lines (vLLM's; default: all)",
        },
    )
    # --- the node on the control plane
    placement: str = field(
        default="prefix",
        metadata={
            "flag": "--placement",
            "choices": ("prefix", "blind"),
            "help": "prefix: a request waits for the engine holding most of its prompt's KV "
            "cache, weighted by load (another takes it after that engine's --steal-after-ms); "
            "blind: for whichever engine claims first. Default %(default)s",
        },
    )
    api_id: str | None = None  # None: a new one (new_api_id), as the node starts
    request_ttl_s: int = REQUEST_TTL_S  # a story (from its accept) and conversation are kept this long

    @property
    def model_name(self) -> str:
        """The model's name in answers: ``served_model_name``'s first, else the model dir's."""
        return self._names()[0]

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """``served_model_name``'s other names, which a request may use too."""
        first, *rest = self._names()
        return tuple(n for n in rest if n != first)

    def _names(self) -> list[str]:
        names = self.served_model_name or [Path(self.model_dir).name]
        return [names] if isinstance(names, str) else list(names)

    def limits(self, vocab_size: int | None) -> Limits:
        """What a request is checked against (fd.api.validation): the served model's names,
        context and defaults here, with its tokenizer's vocabulary."""
        if self.max_model_len is None:
            raise ValueError("ApiConfig.max_model_len is None: start_api fills in the model's")
        return Limits(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            max_body_bytes=self.max_body_bytes,
            default_max_tokens=self.default_max_tokens,
            vocab_size=vocab_size,
            tool_parser=self.tool_parser,
            sampling_defaults=dict(self.sampling_defaults),
            max_output_tokens=self.max_output_tokens,
            reasoning_parser=self.reasoning_parser,
            model_aliases=self.model_aliases,
            force_include_usage=self.force_include_usage,
            tokens_as_ids=self.tokens_as_ids,
            priority_scheduling=self.priority_scheduling,
            lora_names=tuple(self.lora_modules),
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The HTTPS context of the ``ssl_*`` settings (None: plain HTTP). Raises ValueError,
        naming the flag, for one that does not go with the others or a file that cannot be read."""
        if self.ssl_certfile is None:
            if self.ssl_keyfile or self.ssl_ca_certs or self.ssl_cert_reqs:
                raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs:
                ctx.load_verify_locations(self.ssl_ca_certs)
            if self.ssl_ciphers:
                ctx.set_ciphers(self.ssl_ciphers)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs/--ssl-ciphers: {e}") from None
        ctx.verify_mode = ssl.VerifyMode(self.ssl_cert_reqs)
        return ctx
