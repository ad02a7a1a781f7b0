"""Anthropic Messages and OpenAI Responses through the whole stack: the real proxy,
the real swapper, the real llama-server container with SmolLM2 (and CPU vLLM), with
the real anthropic and openai SDKs, streamed and not, with and without the client's
web search tool (which the proxy turns into a function tool the backend accepts).

Both pinned backends serve /v1/messages and /v1/responses themselves (llama.cpp's
llama-server and vLLM 0.32), so nothing is translated to chat completions here."""
import anthropic
import openai
import pytest

from tests.support.proxyproc import ProxyProcess
from tests.support.searxng import FakeSearxng

WEB_A = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
USER = [{"role": "user", "content": "Say hello."}]
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
SEARCH = pytest.mark.parametrize("search", [False, True], ids=["plain", "search-tool"])


@pytest.fixture(scope="module")
def proxy(swapper):
    with FakeSearxng() as searx, ProxyProcess(BACKEND_URL=swapper.url, SEARXNG_URL=searx.url,
                                              SYSTEM_PROMPT="You are terse.") as p:
        yield p


@pytest.fixture(autouse=True)
def _unload_between_tests():
    """Overrides the swapper tests' unload after each test: these tests prove what
    each dialect carries, not loads, so the model one test leaves resident serves
    the next (both dialects' vLLM tests share one CPU vLLM start, ~30 s; the
    llama.cpp ones one tiny-a load). The module's swapper removes it at the end."""
    yield


def claude(proxy) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0, timeout=600)


def codex(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=600)


def messages(proxy, model: str, stream: bool, search: bool):
    kw = dict(model=model, max_tokens=8, messages=USER)
    if search:
        kw["tools"] = [WEB_A]
    if not stream:
        return claude(proxy).messages.create(**kw)
    with claude(proxy).messages.stream(**kw) as s:
        texts = list(s.text_stream)
        msg = s.get_final_message()
    assert "".join(texts) == "".join(b.text for b in msg.content if b.type == "text")
    return msg


def responses(proxy, model: str, stream: bool, search: bool):
    kw = dict(model=model, max_output_tokens=16, input="Say hello.")
    if search:
        kw["tools"] = [{"type": "web_search"}]
    if not stream:
        return codex(proxy).responses.create(**kw)
    events = list(codex(proxy).responses.create(stream=True, **kw))
    # a tiny model may spend its 16 tokens before it ends: the stream then ends
    # with response.incomplete (max_output_tokens), a whole answer all the same
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    if events[-1].type == "response.incomplete":
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text
    return events[-1].response


@STREAM
@SEARCH
def test_messages_llamacpp(proxy, stream, search):
    msg = messages(proxy, "tiny-a", stream, search)
    assert msg.type == "message" and msg.role == "assistant"
    text = [b for b in msg.content if b.type == "text"]
    assert text and text[0].text
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.output_tokens > 0
    if search:
        assert msg.usage.server_tool_use.web_search_requests >= 0
        assert not any(b.type == "tool_use" and b.name == "web_search" for b in msg.content)


@STREAM
@SEARCH
def test_responses_llamacpp(proxy, stream, search):
    resp = responses(proxy, "tiny-a", stream, search)
    assert resp.status in ("completed", "incomplete")
    assert resp.output_text
    assert resp.usage.output_tokens > 0
    assert not any(i.type == "function_call" and i.name == "web_search" for i in resp.output)


def test_unknown_model_in_each_dialects_error_shape(proxy):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude(proxy).messages.create(model="no-such-model", max_tokens=4, messages=USER)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "tiny-a" in e.value.body["error"]["message"], "names the known models"
    with pytest.raises(openai.NotFoundError) as e:
        codex(proxy).responses.create(model="no-such-model", input="hi")
    assert "tiny-a" in e.value.body["message"]


@pytest.mark.parametrize("dialect", ["messages", "responses"])
def test_vllm_serves_both_dialects(proxy, dialect):
    """CPU vLLM (cold start: minutes) answers both dialects, streamed and not (the
    first of the two swaps to it from tiny-a; the second finds it resident)."""
    for stream in (False, True):
        if dialect == "messages":
            msg = messages(proxy, "tiny-vllm", stream, search=True)
            assert msg.content[-1].text
        else:
            resp = responses(proxy, "tiny-vllm", stream, search=True)
            assert resp.output_text
