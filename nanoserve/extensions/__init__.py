"""Optional ideas on top of the core, one module each, imported only when their setting is on.

Each attaches at one of the core's three declared points, which its docstring names: an
Extension (model_runner.Extension, built by LLMEngine.switch_on), a StepLoop (llm_engine.StepLoop,
built by LLMEngine._make_loop), or the backends (`backends(chosen, config)` or a `graph_runner`,
called by model_runner.choose_backends and the model runner). Deleting this folder leaves a whole
engine.
"""
