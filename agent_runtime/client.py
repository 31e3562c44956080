"""Small httpx clients for an OpenAI-compatible server (ours or vLLM), for the http backend.

:class:`AsymCacheClient` is synchronous, :class:`AsyncAsymCacheClient` asynchronous (many jobs
at once from one event loop). Both send Continuum's ``job_id`` / ``is_last_step`` in the body,
return the server's JSON as dicts, stream chat chunks as an iterator of dicts, and raise
:class:`AsymCacheAPIError` for error responses.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import httpx


class AsymCacheAPIError(RuntimeError):
    """An error response.

    Attributes:
        status: HTTP status.
        message: the error message.
        type: OpenAI error type.
        param: offending field.
        code: error code.
    """

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def _raise_for(status: int, content: bytes) -> None:
    if status < 400:
        return
    try:
        err = json.loads(content).get("error", {})
    except (json.JSONDecodeError, AttributeError):
        err = {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    raise AsymCacheAPIError(
        status, str(err.get("message") or content[:500].decode("utf-8", "replace")),
        err.get("type"), err.get("param"), err.get("code"),
    )


def _chat_body(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    max_tokens: int | None,
    job_id: str | None,
    is_last_step: bool,
    stream: bool,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages], **extra}
    if tools:
        body["tools"] = [dict(t) for t in tools]
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if job_id is not None:
        body["job_id"] = job_id
    if is_last_step:
        body["is_last_step"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _sse_data(line: str) -> Any | None:
    """The JSON of one ``data:`` line; None for other lines and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


class AsymCacheClient:
    """Synchronous client.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` is added).
        api_key: bearer key, if the server wants one.
        model: model name to send (default: the first of ``/v1/models``, fetched once).
        timeout: request timeout in seconds.
    """

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._model = model

    def __enter__(self) -> AsymCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _get(self, path: str) -> httpx.Response:
        r = self._http.get(path)
        _raise_for(r.status_code, r.content)
        return r

    @property
    def model(self) -> str:
        """The model name sent with requests."""
        if self._model is None:
            self._model = self.models()[0]
        return self._model

    def models(self) -> list[str]:
        """Model ids the server lists.

        Returns:
            The ids.
        """
        return [m["id"] for m in self._get("/v1/models").json()["data"]]

    def health(self) -> bool:
        """Whether ``/health`` answers 200.

        Returns:
            True when healthy.
        """
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``.

        Returns:
            The text.
        """
        return self._get("/metrics").text

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        max_tokens: int | None = None,
        job_id: str | None = None,
        is_last_step: bool = False,
        **extra: Any,
    ) -> dict[str, Any]:
        """One chat completion.

        Args:
            messages: OpenAI messages.
            tools: tool schemas.
            tool_choice: ``auto``/``none``/``required`` or a named function.
            max_tokens: generated tokens at most.
            job_id: Continuum job id.
            is_last_step: the job's last call.
            **extra: further body fields (``temperature``, ``seed``, ``stop``...).

        Returns:
            The ``chat.completion`` object.

        Raises:
            AsymCacheAPIError: an error response.
        """
        body = _chat_body(self.model, messages, tools, tool_choice, max_tokens, job_id, is_last_step, False, extra)
        r = self._http.post("/v1/chat/completions", json=body)
        _raise_for(r.status_code, r.content)
        return r.json()

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        max_tokens: int | None = None,
        job_id: str | None = None,
        is_last_step: bool = False,
        **extra: Any,
    ) -> Iterator[dict[str, Any]]:
        """Stream a chat completion (closing the iterator early aborts the request).

        Args:
            messages: OpenAI messages.
            tools: tool schemas.
            tool_choice: tool choice.
            max_tokens: generated tokens at most.
            job_id: Continuum job id.
            is_last_step: the job's last call.
            **extra: further body fields.

        Yields:
            ``chat.completion.chunk`` objects (the last one carries ``usage``).

        Raises:
            AsymCacheAPIError: an error response.
        """
        body = _chat_body(self.model, messages, tools, tool_choice, max_tokens, job_id, is_last_step, True, extra)
        with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code >= 400:
                _raise_for(r.status_code, r.read())
            for line in r.iter_lines():
                obj = _sse_data(line)
                if obj is not None:
                    yield obj

    def completion(self, prompt: str | Sequence[int], max_tokens: int | None = None, **extra: Any) -> dict[str, Any]:
        """One text completion.

        Args:
            prompt: text or token ids.
            max_tokens: generated tokens at most.
            **extra: further body fields.

        Returns:
            The ``text_completion`` object.

        Raises:
            AsymCacheAPIError: an error response.
        """
        body: dict[str, Any] = {"model": self.model, "prompt": prompt if isinstance(prompt, str) else list(prompt), **extra}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        r = self._http.post("/v1/completions", json=body)
        _raise_for(r.status_code, r.content)
        return r.json()


class AsyncAsymCacheClient:
    """Asynchronous client (same API as :class:`AsymCacheClient`, ``await``-ed).

    Args:
        base_url: server root.
        api_key: bearer key.
        model: model name (default: the first listed, fetched once).
        timeout: request timeout in seconds.
    """

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._model = model

    async def __aenter__(self) -> AsyncAsymCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def model(self) -> str:
        """The model name sent with requests.

        Returns:
            The name.
        """
        if self._model is None:
            self._model = (await self.models())[0]
        return self._model

    async def models(self) -> list[str]:
        """Model ids the server lists.

        Returns:
            The ids.
        """
        r = await self._http.get("/v1/models")
        _raise_for(r.status_code, r.content)
        return [m["id"] for m in r.json()["data"]]

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        max_tokens: int | None = None,
        job_id: str | None = None,
        is_last_step: bool = False,
        **extra: Any,
    ) -> dict[str, Any]:
        """One chat completion (see :meth:`AsymCacheClient.chat`).

        Args:
            messages: OpenAI messages.
            tools: tool schemas.
            tool_choice: tool choice.
            max_tokens: generated tokens at most.
            job_id: Continuum job id.
            is_last_step: the job's last call.
            **extra: further body fields.

        Returns:
            The ``chat.completion`` object.

        Raises:
            AsymCacheAPIError: an error response.
        """
        body = _chat_body(await self.model(), messages, tools, tool_choice, max_tokens, job_id, is_last_step,
                          False, extra)
        r = await self._http.post("/v1/chat/completions", json=body)
        _raise_for(r.status_code, r.content)
        return r.json()

    async def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        max_tokens: int | None = None,
        job_id: str | None = None,
        is_last_step: bool = False,
        **extra: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream a chat completion (see :meth:`AsymCacheClient.chat_stream`).

        Args:
            messages: OpenAI messages.
            tools: tool schemas.
            tool_choice: tool choice.
            max_tokens: generated tokens at most.
            job_id: Continuum job id.
            is_last_step: the job's last call.
            **extra: further body fields.

        Yields:
            Chunk objects.

        Raises:
            AsymCacheAPIError: an error response.
        """
        body = _chat_body(await self.model(), messages, tools, tool_choice, max_tokens, job_id, is_last_step,
                          True, extra)
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code >= 400:
                _raise_for(r.status_code, await r.aread())
            async for line in r.aiter_lines():
                obj = _sse_data(line)
                if obj is not None:
                    yield obj
