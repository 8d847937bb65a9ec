# What both VM tests need from Gitea: the services.gitea settings (Actions on, no sign-up)
# and Python helpers for the test script that drive it the way a user would — an admin made
# with the gitea CLI, an API token, a repository with Actions, workflows pushed with git, job
# results and logs read back through the API.
#
# Gitea API used (go-gitea/gitea routers/api/v1/api.go): POST /users/{user}/tokens,
# POST /user/repos, PATCH /repos/{owner}/{repo}, GET /repos/{owner}/{repo}/actions/jobs and
# GET /repos/{owner}/{repo}/actions/jobs/{job_id}/logs (the job endpoints: Gitea >= 1.25).
{
  # Address Gitea is reached at from the test script and from the controller.
  host,
  adminPassword ? "correct-horse-battery-staple",
}:
{
  settings = {
    server = {
      HTTP_ADDR = "0.0.0.0";
      HTTP_PORT = 3000;
      DOMAIN = host;
      ROOT_URL = "http://${host}:3000/";
    };
    service.DISABLE_REGISTRATION = true;
    actions.ENABLED = true;
  };

  inherit adminPassword;

  # Defines gitea_setup(machine) -> api, push(...), wait_job_completed(...),
  # assert_job_succeeded_with(...). Every wait polls observable state with a deadline.
  testHelpers = ''
    import json
    import shlex

    GITEA = "http://${host}:3000"
    GITEA_CLI = "su -l gitea -c 'GITEA_WORK_DIR=/var/lib/gitea gitea {}'"

    def gitea_setup(machine):
        machine.wait_for_unit("gitea.service")
        machine.wait_for_open_port(3000)
        machine.succeed(GITEA_CLI.format(
            "admin user create --admin --username admin --password ${adminPassword} "
            "--email admin@localhost --must-change-password=false"
        ))
        token = json.loads(machine.succeed(
            "curl -sSf -X POST -u admin:${adminPassword} -H 'Content-Type: application/json' "
            + GITEA + "/api/v1/users/admin/tokens -d "
            + shlex.quote(json.dumps({"name": "test", "scopes": ["write:repository", "write:user", "write:admin"]}))
        ))["sha1"]

        def api(path, method="GET", data=None):
            cmd = (f"curl -sSf -X {method} -H 'Authorization: token {token}' "
                   f"-H 'Content-Type: application/json' {GITEA}/api/v1{path}")
            if data is not None:
                cmd += " -d " + shlex.quote(json.dumps(data))
            return machine.succeed(cmd)

        api("/user/repos", "POST", {"name": "ci", "auto_init": False, "private": False})
        api("/repos/admin/ci", "PATCH", {"has_actions": True})
        return token, api

    def runner_registration_token(machine, path):
        machine.succeed(
            GITEA_CLI.format("actions generate-runner-token")
            + f" | tail -n1 | tr -d '[:space:]' > {path} && test -s {path}"
        )

    def push(machine, branch, workflow):
        """Pushes `workflow` as .gitea/workflows/<branch>.yml on a new branch of admin/ci."""
        machine.succeed(
            f"rm -rf /tmp/{branch} && git init -q -b {branch} /tmp/{branch} && "
            f"mkdir -p /tmp/{branch}/.gitea/workflows && "
            f"cp {workflow} /tmp/{branch}/.gitea/workflows/{branch}.yml && "
            f"git -C /tmp/{branch} add . && "
            f"git -C /tmp/{branch} -c user.name=test -c user.email=test@localhost commit -q -m {branch} && "
            f"git -C /tmp/{branch} push -q http://admin:${adminPassword}@${host}:3000/admin/ci.git {branch}"
        )

    def wait_job_completed(machine, token, api, name, timeout=600):
        machine.wait_until_succeeds(
            f"curl -sSf -H 'Authorization: token {token}' {GITEA}/api/v1/repos/admin/ci/actions/jobs?limit=50 "
            f"| jq -e --arg n {name} '.jobs[] | select(.name == $n and .status == \"completed\")'",
            timeout=timeout,
        )
        jobs = json.loads(api("/repos/admin/ci/actions/jobs?limit=50"))["jobs"]
        return [j for j in jobs if j["name"] == name][0]

    def assert_job_succeeded_with(machine, token, api, name, *lines, timeout=600):
        job = wait_job_completed(machine, token, api, name, timeout)
        assert job["conclusion"] == "success", f"{name}: conclusion {job['conclusion']!r}"
        log = api(f"/repos/admin/ci/actions/jobs/{job['id']}/logs")
        for line in lines:
            assert line in log, f"{name}: {line!r} not in its log:\n{log}"
  '';
}
