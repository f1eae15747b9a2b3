"""The engine process: an LLM run in a process of its own (:class:`~aoti_sessions.llm.RemoteLLM`,
its proxies and the pipe both ends share; the child's main)."""
