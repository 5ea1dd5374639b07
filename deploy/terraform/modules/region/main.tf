# One region on one Kubernetes cluster: a pool of vLLM pods behind a headless Service, and the
# Meridian agents in front of them behind a LoadBalancer. The agents' settings are config.tf's
# rendered template (a ConfigMap); their admin token and etcd client certificate a Secret.

locals {
  labels = {
    "app.kubernetes.io/part-of"    = "meridian"
    "app.kubernetes.io/managed-by" = "terraform"
    "meridian.example/region"      = var.region_id
  }
  vllm_labels  = merge(local.labels, { "app.kubernetes.io/name" = local.vllm_name, "app.kubernetes.io/component" = "inference" })
  agent_labels = merge(local.labels, { "app.kubernetes.io/name" = local.agent_name, "app.kubernetes.io/component" = "agent" })
  uid          = 10001
}

resource "kubernetes_namespace_v1" "region" {
  metadata {
    name   = var.namespace
    labels = merge(local.labels, { "pod-security.kubernetes.io/enforce" = "restricted" })
  }
}

# -- vLLM ------------------------------------------------------------------------------------

resource "kubernetes_service_account_v1" "vllm" {
  metadata {
    name      = local.vllm_name
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.vllm_labels
  }
  automount_service_account_token = false
}

resource "kubernetes_secret_v1" "vllm" {
  metadata {
    name      = "${local.vllm_name}-secrets"
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.vllm_labels
  }
  data = {
    HF_TOKEN = var.hf_token
  }
}

# Headless: DNS answers every ready pod's address, and each pod of the StatefulSet has a name
# of its own (vllm-0.vllm-nodes.<namespace>.svc.cluster.local) that the agents' [[nodes]] use.
resource "kubernetes_service_v1" "vllm" {
  metadata {
    name      = local.vllm_service
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.vllm_labels
  }
  spec {
    cluster_ip                  = "None"
    publish_not_ready_addresses = false
    selector                    = { "app.kubernetes.io/name" = local.vllm_name, "meridian.example/region" = var.region_id }
    port {
      name        = "http"
      port        = var.vllm_port
      target_port = var.vllm_port
    }
  }
}

# A StatefulSet rather than a Deployment: its pods keep their names across restarts, so the
# agents' static node list stays right, and each keeps its model volume (no re-download).
resource "kubernetes_stateful_set_v1" "vllm" {
  metadata {
    name      = local.vllm_name
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.vllm_labels
  }

  spec {
    service_name          = kubernetes_service_v1.vllm.metadata[0].name
    replicas              = var.vllm_replicas
    pod_management_policy = "Parallel"

    selector {
      match_labels = { "app.kubernetes.io/name" = local.vllm_name, "meridian.example/region" = var.region_id }
    }

    template {
      metadata {
        labels = local.vllm_labels
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.vllm.metadata[0].name
        automount_service_account_token  = false
        termination_grace_period_seconds = 120
        node_selector                    = var.gpu_node_selector

        toleration {
          key      = "nvidia.com/gpu"
          operator = "Exists"
          effect   = "NoSchedule"
        }

        security_context {
          run_as_non_root = true
          run_as_user     = local.uid
          run_as_group    = local.uid
          fs_group        = local.uid
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "vllm"
          image             = var.vllm_image
          image_pull_policy = "IfNotPresent"
          command           = ["vllm", "serve"]
          args = [
            var.model,
            "--host", "0.0.0.0",
            "--port", tostring(var.vllm_port),
            "--enable-prefix-caching",
            "--tensor-parallel-size", tostring(var.gpus_per_node),
          ]

          port {
            name           = "http"
            container_port = var.vllm_port
          }

          env {
            name  = "HF_HOME"
            value = "/models"
          }
          env {
            name  = "HOME"
            value = "/tmp"
          }
          env {
            name = "HF_TOKEN"
            value_from {
              secret_key_ref {
                name = kubernetes_secret_v1.vllm.metadata[0].name
                key  = "HF_TOKEN"
              }
            }
          }

          resources {
            requests = {
              cpu              = var.vllm_resources.cpu
              memory           = var.vllm_resources.memory
              "nvidia.com/gpu" = tostring(var.gpus_per_node)
            }
            limits = {
              cpu              = var.vllm_resources.cpu
              memory           = var.vllm_resources.memory
              "nvidia.com/gpu" = tostring(var.gpus_per_node)
            }
          }

          # Loading weights and warming up takes minutes: the startup probe allows 30 of them
          # before liveness takes over.
          startup_probe {
            http_get {
              path = "/health"
              port = var.vllm_port
            }
            period_seconds    = 10
            failure_threshold = 180
          }
          readiness_probe {
            http_get {
              path = "/health"
              port = var.vllm_port
            }
            period_seconds    = 5
            timeout_seconds   = 3
            failure_threshold = 3
          }
          liveness_probe {
            http_get {
              path = "/health"
              port = var.vllm_port
            }
            period_seconds    = 10
            timeout_seconds   = 5
            failure_threshold = 6
          }

          security_context {
            allow_privilege_escalation = false
            privileged                 = false
            read_only_root_filesystem  = true
            run_as_non_root            = true
            run_as_user                = local.uid
            capabilities {
              drop = ["ALL"]
            }
            seccomp_profile {
              type = "RuntimeDefault"
            }
          }

          volume_mount {
            name       = "models"
            mount_path = "/models"
          }
          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
          volume_mount {
            name       = "shm"
            mount_path = "/dev/shm"
          }
        }

        volume {
          name = "tmp"
          empty_dir {
            size_limit = "8Gi"
          }
        }
        # NCCL's shared memory between tensor-parallel workers.
        volume {
          name = "shm"
          empty_dir {
            medium     = "Memory"
            size_limit = "16Gi"
          }
        }
      }
    }

    volume_claim_template {
      metadata {
        name = "models"
      }
      spec {
        access_modes       = ["ReadWriteOnce"]
        storage_class_name = var.storage_class_name
        resources {
          requests = {
            storage = var.model_cache_size
          }
        }
      }
    }
  }

  timeouts {
    create = "60m"
    update = "60m"
  }
}

# -- the agents ------------------------------------------------------------------------------

resource "kubernetes_service_account_v1" "agent" {
  metadata {
    name      = local.agent_name
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.agent_labels
  }
  automount_service_account_token = false
}

resource "kubernetes_config_map_v1" "agent" {
  metadata {
    name      = "${local.agent_name}-config"
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.agent_labels
  }
  data = {
    "agent.toml" = local.agent_config
  }
}

resource "kubernetes_secret_v1" "agent" {
  metadata {
    name      = "${local.agent_name}-secrets"
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.agent_labels
  }
  # Mounted as files (admin.token_file and region.etcd_*_file in agent.toml), never in the
  # environment: nothing the agent starts can inherit them. The admin token is read at start;
  # the etcd certificate and key for each new connection to etcd, so a renewed pair written
  # here reaches the running agents through the kubelet's update of the mount.
  data = local.agent_secret_data
}

resource "kubernetes_deployment_v1" "agent" {
  #checkov:skip=CKV_K8S_14:the image is var.agent_image, which variables.tf validates to be pinned by digest (repository@sha256:...); checkov cannot resolve the variable
  #checkov:skip=CKV_K8S_43:the image is var.agent_image, which variables.tf validates to be pinned by digest; checkov cannot resolve the variable
  #checkov:skip=CKV_K8S_15:a digest-pinned image cannot change, so IfNotPresent is right: Always would make every pod start depend on the registry being up
  metadata {
    name      = local.agent_name
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.agent_labels
  }

  spec {
    replicas = var.agent_replicas

    selector {
      match_labels = { "app.kubernetes.io/name" = local.agent_name, "meridian.example/region" = var.region_id }
    }

    # One agent stopped, then its replacement started: with the required one-agent-per-host
    # anti-affinity below, a surge (maxSurge 1) would need a spare node for the new pod, and
    # without one the rollout would hang Pending. The region keeps agent_replicas - 1 agents
    # serving meanwhile (docs/deploy.md sizes for one lost during a rollout).
    strategy {
      type = "RollingUpdate"
      rolling_update {
        max_unavailable = "1"
        max_surge       = "0"
      }
    }

    template {
      metadata {
        labels = local.agent_labels
        annotations = {
          # A new config rolls the agents.
          "meridian.example/config-sha256" = sha256(local.agent_config)
        }
      }

      spec {
        service_account_name            = kubernetes_service_account_v1.agent.metadata[0].name
        automount_service_account_token = false
        # The preStop sleep, the agent's 60 s for requests in flight, 10 s to revoke its etcd
        # lease and flush (config.tf, agent_termination_grace_s).
        termination_grace_period_seconds = local.agent_termination_grace_s

        affinity {
          pod_anti_affinity {
            # One agent per host: losing a host loses one agent, never the region's last.
            required_during_scheduling_ignored_during_execution {
              topology_key = "kubernetes.io/hostname"
              label_selector {
                match_labels = { "app.kubernetes.io/name" = local.agent_name, "meridian.example/region" = var.region_id }
              }
            }
          }
        }

        security_context {
          run_as_non_root = true
          run_as_user     = local.uid
          run_as_group    = local.uid
          fs_group        = local.uid
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "agent"
          image             = var.agent_image
          image_pull_policy = "IfNotPresent"
          command           = ["meridian-agent", "--config", "/etc/meridian/agent.toml"]

          port {
            name           = "http"
            container_port = var.agent_port
          }

          # Before SIGTERM: keep serving while the pod leaves the Service's endpoints and the
          # balancer's health check of this node fails (externalTrafficPolicy Local), so that
          # new connections stop arriving before the agent closes its listener.
          lifecycle {
            pre_stop {
              exec {
                command = ["sleep", tostring(var.agent_shutdown_delay_s)]
              }
            }
          }

          resources {
            requests = {
              cpu    = var.agent_resources.cpu
              memory = var.agent_resources.memory
            }
            limits = {
              cpu    = var.agent_resources.cpu
              memory = var.agent_resources.memory
            }
          }

          # /ready is 200 while some vLLM node is routable: an agent with none leaves the
          # balancer, and the controller judges the region by what the agents publish.
          readiness_probe {
            http_get {
              path = "/ready"
              port = var.agent_port
            }
            period_seconds    = 5
            timeout_seconds   = 2
            failure_threshold = 2
          }
          liveness_probe {
            http_get {
              path = "/health"
              port = var.agent_port
            }
            initial_delay_seconds = 5
            period_seconds        = 10
            timeout_seconds       = 3
            failure_threshold     = 3
          }

          security_context {
            allow_privilege_escalation = false
            privileged                 = false
            read_only_root_filesystem  = true
            run_as_non_root            = true
            run_as_user                = local.uid
            capabilities {
              drop = ["ALL"]
            }
            seccomp_profile {
              type = "RuntimeDefault"
            }
          }

          volume_mount {
            name       = "config"
            mount_path = "/etc/meridian"
            read_only  = true
          }
          volume_mount {
            name       = "secrets"
            mount_path = local.secrets_dir
            read_only  = true
          }
          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "config"
          config_map {
            name = kubernetes_config_map_v1.agent.metadata[0].name
          }
        }
        volume {
          name = "secrets"
          secret {
            secret_name  = kubernetes_secret_v1.agent.metadata[0].name
            default_mode = "0440" # root and the pod's fs_group (the agent's gid) only
          }
        }
        volume {
          name = "tmp"
          empty_dir {
            size_limit = "256Mi"
          }
        }
      }
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "agent" {
  metadata {
    name      = local.agent_name
    namespace = kubernetes_namespace_v1.region.metadata[0].name
    labels    = local.agent_labels
  }
  spec {
    # Node drains take one agent at a time (the rollout itself follows the strategy above).
    max_unavailable = "1"
    selector {
      match_labels = { "app.kubernetes.io/name" = local.agent_name, "meridian.example/region" = var.region_id }
    }
  }
}

resource "kubernetes_service_v1" "agent" {
  metadata {
    name        = local.agent_name
    namespace   = kubernetes_namespace_v1.region.metadata[0].name
    labels      = local.agent_labels
    annotations = var.load_balancer_annotations
  }
  spec {
    type                    = "LoadBalancer"
    load_balancer_ip        = var.load_balancer_ip
    external_traffic_policy = "Local" # clients' own addresses reach the agents; no second hop
    selector                = { "app.kubernetes.io/name" = local.agent_name, "meridian.example/region" = var.region_id }
    port {
      name        = "http"
      port        = var.public_port
      target_port = var.agent_port
    }
  }
}
