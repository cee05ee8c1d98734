"""Groups from a pipeline's declarations: vLLM-Omni's ClassVars and component discovery
(`discovery`), and split models, one reasoner and one generator (`split`).

No imports here: importing one module of the folder imports only what it needs."""
