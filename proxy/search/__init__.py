"""Server-side web_search: SearXNG client, result formatting, the model <-> search loop."""
