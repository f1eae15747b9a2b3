"""Run time: an LLM package served (:class:`~aoti_sessions.llm.LLM`, chat sessions, the step
loop and its scheduler, generations, sampling, text, prompts, replies and tools), in this process."""
