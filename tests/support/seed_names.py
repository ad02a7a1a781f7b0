"""The seed router's model ids and aliases (its clients and scripts use them),
with this stack's earlier names kept as aliases."""

SEED_NAMES = {
    "qwen-38-27b": ["qwen38", "qwen38-27b", "qwen36", "qwen36-q6", "qwen36-text",
                    "qwen3.8-27b", "qwen-27b", "qwen", "qwen-vision"],
    "qwen-35b": ["qwen36-35b", "qwen3.8-35b-a3b", "qwen-moe"],
    "qwen-122b": ["qwen35-122b", "qwen3.8-122b-a10b", "qwen-big"],
    "foundation": ["huihui", "qwen-awq"],
}
