"""What a test asks a running swapper (its chat, /running and /metrics), and how it
reads a stream its backend broke off."""
import requests


def chat(url, model, stream=False, max_tokens=8, timeout=180, **extra):
    body = {"messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": max_tokens, "stream": stream, **extra}
    if model is not None:
        body["model"] = model
    return requests.post(url + "/v1/chat/completions", json=body, stream=stream, timeout=timeout)


def running(sw):
    return requests.get(sw.url + "/running", timeout=10).json()


def metric(sw, name, **labels):
    text = requests.get(sw.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels else "")) and want in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def data_until_broken(lines) -> list[bytes]:
    """The `data:` lines of a stream that must end by breaking off (its backend
    died under it): the transfer breaks after them, it does not end."""
    got = []
    try:
        for line in lines:
            if line.startswith(b"data: "):
                got.append(line)
    except requests.exceptions.ChunkedEncodingError:
        return got
    raise AssertionError(f"the stream ended as if whole: {got[-3:]}")
