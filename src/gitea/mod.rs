//! Adapter: Connect client for Gitea RunnerService.
