"""`sm70ctl serve`: pre-flight, launch and supervision of the vLLM OpenAI server."""
