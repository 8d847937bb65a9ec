# The Kubernetes OpenAPI schemas that the fake API server of the tests validates every write
# against (gdr-testkit's fake_kube::schema reads KUBERNETES_SCHEMA_DIR): the
# `kubernetes-json-schema` directory of the PyPI package kubernetes-validate, at the version
# and wheel hash deploy/validate.sh pins (tests/nix.rs checks that the two agree). A
# fixed-output fetch, because the build sandbox of `checks.nextest` has no pip and no network.
{ pkgs }:
let
  version = "1.37.0";
  wheel = pkgs.fetchurl {
    url = "https://files.pythonhosted.org/packages/b0/50/104f3b5a41aba6737c5f2ffe76270398f3a7320dc4a4f3f88dfd5bc9af63/kubernetes_validate-${version}-py3-none-any.whl";
    sha256 = "85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9";
  };
in
pkgs.runCommand "kubernetes-json-schema-${version}" { nativeBuildInputs = [ pkgs.unzip ]; } ''
  unzip -q ${wheel} 'kubernetes_validate/kubernetes-json-schema/*' -d unpacked
  mv unpacked/kubernetes_validate/kubernetes-json-schema "$out"
''
