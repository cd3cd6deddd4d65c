"""Example agent harnesses for ``rollout.harness.command``: standalone programs (standard library only) that
speak OpenAI's API to the recording proxy. Copy one as the start of your own."""
