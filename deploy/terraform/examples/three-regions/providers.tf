# One Kubernetes cluster per region, each its own provider alias (a module's provider cannot be
# chosen by for_each, so the three regions are three module blocks).

provider "kubernetes" {
  alias          = "us_east"
  config_path    = var.kubeconfig_path
  config_context = var.kube_contexts["us-east"]
}

provider "kubernetes" {
  alias          = "eu_west"
  config_path    = var.kubeconfig_path
  config_context = var.kube_contexts["eu-west"]
}

provider "kubernetes" {
  alias          = "eu_central"
  config_path    = var.kubeconfig_path
  config_context = var.kube_contexts["eu-central"]
}
