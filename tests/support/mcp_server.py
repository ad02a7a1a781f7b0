"""A minimal MCP server over stdio (JSON-RPC 2.0, one message a line) with one tool,
`lookup`, for the real Codex CLI (tests/integration/proxy/test_agents.py): Codex
groups an MCP server's tools in a `namespace` tool (`mcp__<server>__`)."""
import json
import sys

TOOL = {"name": "lookup", "description": "Look a word up in the docs.",
        "inputSchema": {"type": "object", "properties": {"word": {"type": "string"}},
                        "required": ["word"]}}


def answer(msg_id, result):
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": result}) + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    method, mid = msg.get("method"), msg.get("id")
    if mid is None:
        continue                    # a notification
    if method == "initialize":
        answer(mid, {"protocolVersion": msg.get("params", {}).get("protocolVersion", "2025-06-18"),
                     "capabilities": {"tools": {}},
                     "serverInfo": {"name": "docs", "version": "1.0"}})
    elif method == "tools/list":
        answer(mid, {"tools": [TOOL]})
    elif method == "tools/call":
        word = (msg.get("params", {}).get("arguments") or {}).get("word", "")
        answer(mid, {"content": [{"type": "text", "text": f"DEFINITION of {word}: a greeting"}]})
    else:
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": mid,
                                     "error": {"code": -32601, "message": "no such method"}}) + "\n")
        sys.stdout.flush()
