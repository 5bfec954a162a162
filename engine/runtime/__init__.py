"""The engine process: EngineCore (admit, step, report), the model runner, CUDA graphs, overlap, likelihood jobs, start-up, the process loop and its children, the offline Engine."""
