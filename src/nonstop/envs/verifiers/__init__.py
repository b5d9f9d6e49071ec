"""Environments from verifiers (`env.name: verifiers/<module:factory>`, the `verifiers` extra;
docs/environments.md). Importing the package loads no verifiers.

- env.py       a verifiers.v1 Taskset played through verifiers' train client on nonstop's engines
               (`VerifiersPlayer`);
- client.py    verifiers' train client answered by nonstop's engines, in process (`EngineTransport`);
- agent.py     `env.verifiers_rollout: agent`: verifiers' own `Agent.run` per episode, its
               interception and MCP tool servers, on nonstop's engines (`AgentPlayer`);
- harness.py   verifiers' `null` harness chat program run in process (`InProcessChatHarness`);
- renderer.py  `TokenRenderer`: a renderer for tokenizers without a chat template, tool calls included;
- tasks.py     example verifiers.v1 tasksets for the tiny model: addition, products with a calculator tool.
"""
