"""Experiment state on storage: the manifest (what is committed), the lock (who runs), metrics,
plots, TensorBoard files, promotions and (optional) MLflow tracking."""
